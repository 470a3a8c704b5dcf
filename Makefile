# vfiod: build and install.
#
#   cargo build --release                      (or: make)
#   make install [DESTDIR=/tmp/stage] [PREFIX=/usr/local] [SYSCONFDIR=/etc]
#   make uninstall                             (same variables; leaves /etc/vfiod alone)
#   make deb                                   target/debian/vfiod_VERSION_ARCH.deb (packaging/deb)
#
# `cargo build --release` builds every package of the workspace (all are default members): vfiod,
# vfioctl and vfiod-qemu-hook (the root package) and vfiod-pool (crates/vfiod-pool), into one
# target directory. `make install` only copies: it never builds, so it also runs where there is
# no Rust toolchain (the test guests install from a read-only share of this tree).

PREFIX      ?= /usr/local
SYSCONFDIR  ?= /etc
BINDIR      ?= $(PREFIX)/bin
SBINDIR     ?= $(PREFIX)/sbin
LIBEXECDIR  ?= $(PREFIX)/libexec
DATADIR     ?= $(PREFIX)/share
UNITDIR     ?= $(PREFIX)/lib/systemd/system
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
# dbus-daemon reads policies from /usr/share/dbus-1/system.d and /etc/dbus-1/system.d only.
DBUS_POLICYDIR ?= $(if $(filter /usr,$(PREFIX)),$(DATADIR)/dbus-1/system.d,$(SYSCONFDIR)/dbus-1/system.d)
# polkitd reads actions from /usr/share/polkit-1/actions only, whatever the prefix.
POLKIT_ACTIONDIR ?= /usr/share/polkit-1/actions
# The introspection XML of each D-Bus interface, where client generators (gdbus-codegen,
# zbus-xmlgen, qdbusxml2cpp) and D-Bus tools look for them.
DBUS_INTERFACEDIR ?= $(DATADIR)/dbus-1/interfaces
CONFDIR     ?= $(SYSCONFDIR)/vfiod
DOCDIR      ?= $(DATADIR)/doc/vfiod
HOOKDIR     ?= $(SYSCONFDIR)/libvirt/hooks/qemu.d
MANDIR      ?= $(DATADIR)/man
# Where bash-completion, zsh and fish look for a package's completions.
BASHCOMPDIR ?= $(DATADIR)/bash-completion/completions
ZSHCOMPDIR  ?= $(DATADIR)/zsh/vendor-completions
FISHCOMPDIR ?= $(DATADIR)/fish/vendor_completions.d

CARGO_TARGET_DIR ?= target
RELEASE     := $(CARGO_TARGET_DIR)/release

INSTALL     ?= install
# One file per interface, kept equal to what the daemon serves by
# tests/simulated/dbus_interfaces.rs.
INTERFACES  := $(wildcard dbus/interfaces/org.vfiod.Vfiod1.*.xml)
# The man pages, under MANDIR.
MANPAGES    := man1/vfioctl.1 man1/vfiod-pool.1 man5/vfiod.toml.5 man8/vfiod.8

.PHONY: all build install uninstall deb

all: build

build:
	cargo build --release

install:
	@for bin in vfiod vfioctl vfiod-pool vfiod-qemu-hook vfiod-libvirt; do \
	  test -x $(RELEASE)/$$bin || { echo "make install: $(RELEASE)/$$bin is missing: run 'cargo build --release' first" >&2; exit 1; }; \
	done
	@test -f conf/vfiod.toml || { echo "make install: conf/vfiod.toml is missing" >&2; exit 1; }
	@test -n "$(INTERFACES)" || { echo "make install: dbus/interfaces/*.xml are missing" >&2; exit 1; }
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod $(DESTDIR)$(SBINDIR)/vfiod
	@# The process vfiod's libvirt client runs in; vfiod finds it in ../libexec of its own
	@# directory (host::libvirt::helper_path).
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod-libvirt $(DESTDIR)$(LIBEXECDIR)/vfiod-libvirt
	$(INSTALL) -D -m 0755 $(RELEASE)/vfioctl $(DESTDIR)$(BINDIR)/vfioctl
	@# The reference pool service and its stand-in driver (crates/vfiod-pool,
	@# docs/pool-protocol.md); no unit: a pool runs where the operator chooses, usually not on
	@# every host.
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod-pool $(DESTDIR)$(BINDIR)/vfiod-pool
	@# The man pages and the shell completions, printed by the binaries just built (generated
	@# from their option definitions, and vfiod.toml.5 from docs/config.md compiled into vfiod:
	@# they cannot drift from them). Running them builds nothing.
	$(INSTALL) -d -m 0755 $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man5 $(DESTDIR)$(MANDIR)/man8 \
	  $(DESTDIR)$(BASHCOMPDIR) $(DESTDIR)$(ZSHCOMPDIR) $(DESTDIR)$(FISHCOMPDIR)
	$(RELEASE)/vfioctl man > $(DESTDIR)$(MANDIR)/man1/vfioctl.1
	$(RELEASE)/vfiod-pool man > $(DESTDIR)$(MANDIR)/man1/vfiod-pool.1
	$(RELEASE)/vfiod --man vfiod.8 > $(DESTDIR)$(MANDIR)/man8/vfiod.8
	$(RELEASE)/vfiod --man vfiod.toml.5 > $(DESTDIR)$(MANDIR)/man5/vfiod.toml.5
	$(RELEASE)/vfioctl completions bash > $(DESTDIR)$(BASHCOMPDIR)/vfioctl
	$(RELEASE)/vfioctl completions zsh > $(DESTDIR)$(ZSHCOMPDIR)/_vfioctl
	$(RELEASE)/vfioctl completions fish > $(DESTDIR)$(FISHCOMPDIR)/vfioctl.fish
	chmod 0644 $(addprefix $(DESTDIR)$(MANDIR)/,$(MANPAGES)) $(DESTDIR)$(BASHCOMPDIR)/vfioctl \
	  $(DESTDIR)$(ZSHCOMPDIR)/_vfioctl $(DESTDIR)$(FISHCOMPDIR)/vfioctl.fish
	$(INSTALL) -d -m 0755 $(DESTDIR)$(UNITDIR)
	sed -e 's|/usr/local/sbin/vfiod|$(SBINDIR)/vfiod|' -e 's|/etc/vfiod/|$(CONFDIR)/|g' \
	  -e 's|/usr/local/share/doc/vfiod/|$(DOCDIR)/|g' systemd/vfiod.service > $(DESTDIR)$(UNITDIR)/vfiod.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/vfiod.service
	@# The unit's Documentation= points here.
	$(INSTALL) -D -m 0644 README.md $(DESTDIR)$(DOCDIR)/README.md
	$(INSTALL) -D -m 0644 docs/polkit.md $(DESTDIR)$(DOCDIR)/polkit.md
	$(INSTALL) -D -m 0644 docs/dbus.md $(DESTDIR)$(DOCDIR)/dbus.md
	$(INSTALL) -D -m 0644 systemd/tmpfiles.d/vfiod.conf $(DESTDIR)$(TMPFILESDIR)/vfiod.conf
	$(INSTALL) -D -m 0644 conf/dbus-1/system.d/org.vfiod.Vfiod1.conf $(DESTDIR)$(DBUS_POLICYDIR)/org.vfiod.Vfiod1.conf
	$(INSTALL) -D -m 0644 polkit/org.vfiod.vfiod1.policy $(DESTDIR)$(POLKIT_ACTIONDIR)/org.vfiod.vfiod1.policy
	$(INSTALL) -d -m 0755 $(DESTDIR)$(DBUS_INTERFACEDIR)
	$(INSTALL) -m 0644 $(INTERFACES) $(DESTDIR)$(DBUS_INTERFACEDIR)/
	$(INSTALL) -d -m 0755 $(DESTDIR)$(CONFDIR) $(DESTDIR)$(CONFDIR)/conf.d
	@# An administrator's configuration is never overwritten.
	@if [ -e $(DESTDIR)$(CONFDIR)/vfiod.toml ]; then \
	  echo "keeping existing $(DESTDIR)$(CONFDIR)/vfiod.toml"; \
	else \
	  echo "$(INSTALL) -m 0644 conf/vfiod.toml $(DESTDIR)$(CONFDIR)/vfiod.toml"; \
	  $(INSTALL) -m 0644 conf/vfiod.toml $(DESTDIR)$(CONFDIR)/vfiod.toml; \
	fi
	@# libvirt's qemu hook: libvirt runs every executable in HOOKDIR, following a symlink, and
	@# waits for it on every VM start; a binary of its own, not a shell script (hooks/README.md).
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod-qemu-hook $(DESTDIR)$(LIBEXECDIR)/vfiod-qemu-hook
	$(INSTALL) -d -m 0755 $(DESTDIR)$(HOOKDIR)
	ln -sfn $(LIBEXECDIR)/vfiod-qemu-hook $(DESTDIR)$(HOOKDIR)/vfiod
	@echo "libvirt reads its hook directory when it starts: restart libvirtd (or virtqemud) once"

uninstall:
	rm -f $(DESTDIR)$(SBINDIR)/vfiod $(DESTDIR)$(BINDIR)/vfioctl $(DESTDIR)$(BINDIR)/vfiod-pool
	rm -f $(DESTDIR)$(UNITDIR)/vfiod.service $(DESTDIR)$(TMPFILESDIR)/vfiod.conf
	rm -f $(addprefix $(DESTDIR)$(MANDIR)/,$(MANPAGES)) $(DESTDIR)$(BASHCOMPDIR)/vfioctl \
	  $(DESTDIR)$(ZSHCOMPDIR)/_vfioctl $(DESTDIR)$(FISHCOMPDIR)/vfioctl.fish
	rm -f $(DESTDIR)$(DOCDIR)/README.md $(DESTDIR)$(DOCDIR)/polkit.md $(DESTDIR)$(DOCDIR)/dbus.md
	rmdir $(DESTDIR)$(DOCDIR) 2>/dev/null || true
	rm -f $(DESTDIR)$(DBUS_POLICYDIR)/org.vfiod.Vfiod1.conf $(DESTDIR)$(POLKIT_ACTIONDIR)/org.vfiod.vfiod1.policy
	rm -f $(addprefix $(DESTDIR)$(DBUS_INTERFACEDIR)/,$(notdir $(INTERFACES)))
	rm -f $(DESTDIR)$(HOOKDIR)/vfiod $(DESTDIR)$(LIBEXECDIR)/vfiod-qemu-hook \
	  $(DESTDIR)$(LIBEXECDIR)/vfiod-libvirt
	@echo "left in place: $(DESTDIR)$(CONFDIR) (configuration) and /var/lib/vfiod (state)"

# A Debian package of the release build: make install's layout under PREFIX=/usr, packaging/deb's
# maintainer scripts (enable and start on install, stop on remove, purge removes /etc/vfiod and
# /var/lib/vfiod). Like install, it never builds.
deb:
	@packaging/deb/build
