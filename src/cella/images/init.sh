#!/bin/sh
# cella initramfs: load the virtio modules, mount the root disk, hand PID 1 to the agent.
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules/order); do insmod "/modules/$m"; done
fail() { echo "cella-init: $*" > /dev/console; reboot -f; }
case " $(cat /proc/cmdline) " in
  *" cella.probe "*) echo CELLA-PROBE-OK > /dev/console; reboot -f ;;
esac
i=0
while [ ! -b /dev/vda ]; do
  i=$((i + 1)); [ $i -gt 1000 ] && fail "no root disk"; sleep 0.01
done
mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount the root disk"
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run || fail "cannot mount /run"
mkdir -p /newroot/run/cella && cp /cella-agent /newroot/run/cella/agent || fail "no agent"
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /run/cella/agent
