#!/bin/sh
# mmdebstrap --customize-hook for the test guest image: runs on the outer machine after the packages are
# installed, with the new root file system as $1. The harness passes the ssh key through TESTBED_SSH_KEY.
set -eu
root=$1
here=$(dirname "$0")

cp -a "$here/rootfs/." "$root/"

# One key for everything: the harness logs in with it, and guests use it to reach each other (migration).
install -d -m 700 "$root/root/.ssh"
install -m 600 "$TESTBED_SSH_KEY" "$root/root/.ssh/id_ed25519"
install -m 644 "$TESTBED_SSH_KEY.pub" "$root/root/.ssh/id_ed25519.pub"
install -m 600 "$TESTBED_SSH_KEY.pub" "$root/root/.ssh/authorized_keys"
chmod 600 "$root/root/.ssh/config"

echo testbed > "$root/etc/hostname"
echo LANG=C.UTF-8 > "$root/etc/default/locale"
# A fixed machine-id avoids systemd's first-boot logic (preset-all) on every boot of a fresh overlay; each
# guest overrides it with systemd.machine_id= on the kernel command line.
echo 0123456789abcdef0123456789abcdef > "$root/etc/machine-id"

# An unprivileged user: may read vfiod's API, must be refused its mutating calls.
chroot "$root" useradd --create-home --shell /bin/bash tester

chroot "$root" systemctl enable systemd-networkd.service testbed-identity.service
# Nothing periodic may run during a test.
chroot "$root" systemctl mask apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
    man-db.timer logrotate.timer e2scrub_reap.service 2>/dev/null || true
# No NVMe-over-fabrics here; its boot-time connect waits for network-online.target for nothing.
chroot "$root" systemctl mask nvmf-autoconnect.service
# libvirt's NAT network needs dnsmasq and a firewall; nested domains of the tests need no network.
rm -f "$root/etc/libvirt/qemu/networks/autostart/default.xml"

# The kernel boots directly from the outer machine: its initrd needs only the virtio root disk. A small
# initrd (MODULES=list) unpacks and boots seconds faster under TCG than Debian's default MODULES=most.
echo MODULES=list > "$root/etc/initramfs-tools/conf.d/testbed"
for m in virtio_pci virtio_blk ext4; do
    grep -qx "$m" "$root/etc/initramfs-tools/modules" || echo "$m" >> "$root/etc/initramfs-tools/modules"
done
chroot "$root" update-initramfs -u -k all
