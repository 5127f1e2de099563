"""Single-GPU foundations: the driver, streams, NVRTC compilation, kernel launch, dtypes, arrays and
their zero-copy import (CAI / DLPack), TMA tensor maps.  Nothing here knows about ranks."""
