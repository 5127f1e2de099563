"""Distributed state: topology, the per-rank Context, symmetric memory, device signals and the
host-side agreement on calls, side streams for copy-engine work."""
