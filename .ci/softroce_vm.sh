#!/bin/bash
# softroce_vm.sh 'COMMAND' : run COMMAND as root in a throwaway QEMU VM (Debian 12
# kernel, host / shared read-only over 9p, writes go to tmpfs) and exit with its
# exit code. First call installs packages and builds the kernel/initramfs cache.
# The VM has no NIC unless QEMU_EXTRA adds one. OUTDIR (host dir) is mounted rw at
# the same path inside and exported as $RXE_OUT.
set -u
C=${RXE_CACHE:-/var/tmp/rxe-vm}
if [ ! -s "$C/kver" ]; then
  set -e; mkdir -p "$C"; export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends qemu-system-x86 python3-pyverbs \
    ibverbs-providers ibverbs-utils iproute2 busybox-static kmod cpio >/dev/null
  K=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  V=${K#linux-image-}
  (cd "$C" && apt-get download -o APT::Sandbox::User=root "$K" >/dev/null)
  rm -rf "$C/root"; dpkg-deb -x "$C/${K}"_*.deb "$C/root"; rm -f "$C/${K}"_*.deb
  depmod -b "$C/root" "$V"
  # uncompressed vmlinux boots via PVH: no BIOS real mode, no XZ under emulation
  /usr/bin/python3 - "$C/root/boot/vmlinuz-$V" "$C/vmlinux" <<'PY'
import lzma, sys
d = open(sys.argv[1], 'rb').read()
open(sys.argv[2], 'wb').write(lzma.LZMADecompressor().decompress(d[d.find(b'\xfd7zXZ\0'):]))
PY
  S=$(mktemp -d); mkdir -p "$S/bin" "$S/mods"; cp /bin/busybox "$S/bin/"
  M="netfs fscache 9pnet 9p virtio_ring virtio 9pnet_virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci overlay"
  for m in $M; do f=$(modinfo -b "$C/root" -k "$V" -n $m); [ -f "$f" ] && cp "$f" "$S/mods/$m.ko"; done
  echo $M > "$S/mods/order"
  cat > "$S/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin; export PATH=/bin; mkdir -p /proc /sys /dev /sbin /n /rw
mount -t proc p /proc; mount -t sysfs s /sys; mount -t devtmpfs d /dev
arg() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" /proc/cmdline | base64 -d; }
printf '#!/bin/sh\nexec chroot /n /sbin/modprobe "$@"\n' > /sbin/modprobe; chmod +x /sbin/modprobe
for m in $(cat /mods/order); do [ -e /mods/$m.ko ] && insmod /mods/$m.ko; done
O=trans=virtio,version=9p2000.L,access=any,msize=512000
mount -t 9p -o $O,cache=loose,ro hostroot /n || poweroff -f
mount -t tmpfs t /rw
for d in tmp etc var root; do mkdir -p /rw/$d /rw/$d.w
  mount -t overlay o -o lowerdir=/n/$d,upperdir=/rw/$d,workdir=/rw/$d.w /n/$d; done
if [ ! -d /n/lib/modules ]; then mkdir -p /rw/ul /rw/ul.w
  mount -t overlay o -o lowerdir=/n/usr/lib,upperdir=/rw/ul,workdir=/rw/ul.w /n/usr/lib; mkdir /n/usr/lib/modules; fi
mount -t 9p -o $O,cache=loose,ro kmods /n/lib/modules
mount -t proc p /n/proc; mount -t sysfs s /n/sys; mount -t devtmpfs d /n/dev
mkdir -p /n/dev/pts /n/dev/shm; mount -t devpts p /n/dev/pts; mount -t tmpfs t /n/dev/shm; mount -t tmpfs t /n/run
OUT=$(arg rxe_out); mkdir -p "/n$OUT" 2>/dev/null; mount -t 9p -o $O out "/n$OUT"
echo "vm: up at $(cut -d' ' -f1 /proc/uptime)s"
chroot /n /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 RXE_OUT="$OUT" /bin/sh -c "cd /tmp && $(arg rxe_cmd)" </dev/console >/dev/console 2>&1
echo $? > "/n$OUT/rc"; sync; poweroff -f
INIT
  chmod +x "$S/init"; (cd "$S" && find . | cpio -o -H newc --quiet | gzip -1) > "$C/initrd"
  rm -rf "$S"; echo "$V" > "$C/kver"; set +e
fi
OUTDIR=${OUTDIR:-$(mktemp -d /tmp/rxe-out.XXXXXX)}; mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd); rm -f "$OUTDIR/rc"
b64() { printf '%s' "$1" | base64 -w0; }
timeout --foreground -k 5 "${VM_TIMEOUT:-600}" qemu-system-x86_64 -machine q35 \
  -accel tcg,thread=multi -cpu max -m "${MEM:-1G}" -smp "${SMP:-2}" -nodefaults \
  -no-user-config -display none -no-reboot -serial stdio -net none \
  -kernel "$C/vmlinux" -initrd "$C/initrd" -append "console=ttyS0 quiet loglevel=3 \
panic=-1 rdinit=/init rxe_out=$(b64 "$OUTDIR") rxe_cmd=$(b64 "$1")" \
  -fsdev local,id=r,path=/,security_model=none,readonly=on,multidevs=remap \
  -device virtio-9p-pci,fsdev=r,mount_tag=hostroot \
  -fsdev local,id=k,path="$C/root/lib/modules",security_model=none,readonly=on \
  -device virtio-9p-pci,fsdev=k,mount_tag=kmods \
  -fsdev local,id=o,path="$OUTDIR",security_model=none \
  -device virtio-9p-pci,fsdev=o,mount_tag=out ${QEMU_EXTRA:-} </dev/null
[ -f "$OUTDIR/rc" ] && exit "$(cat "$OUTDIR/rc")"
echo "softroce_vm.sh: no exit code from the guest (timeout or crash)" >&2; exit 125
