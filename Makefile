# vfiod: build and install.
#
#   cargo build --release                      (or: make)
#   make install [DESTDIR=/tmp/stage] [PREFIX=/usr/local] [SYSCONFDIR=/etc]
#   make uninstall                             (same variables; leaves /etc/vfiod alone)
#
# `make install` only copies: it never builds, so it also runs where there is no Rust toolchain (the test
# guests install from a read-only share of this tree).

PREFIX      ?= /usr/local
SYSCONFDIR  ?= /etc
BINDIR      ?= $(PREFIX)/bin
SBINDIR     ?= $(PREFIX)/sbin
DATADIR     ?= $(PREFIX)/share
UNITDIR     ?= $(PREFIX)/lib/systemd/system
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
# dbus-daemon reads policies from /usr/share/dbus-1/system.d and /etc/dbus-1/system.d only.
DBUS_POLICYDIR ?= $(if $(filter /usr,$(PREFIX)),$(DATADIR)/dbus-1/system.d,$(SYSCONFDIR)/dbus-1/system.d)
# polkitd reads actions from /usr/share/polkit-1/actions only, whatever the prefix.
POLKIT_ACTIONDIR ?= /usr/share/polkit-1/actions
CONFDIR     ?= $(SYSCONFDIR)/vfiod
HOOKDIR     ?= $(SYSCONFDIR)/libvirt/hooks/qemu.d

CARGO_TARGET_DIR ?= target
RELEASE     := $(CARGO_TARGET_DIR)/release

INSTALL     ?= install
HOOKS       := $(wildcard hooks/qemu.d/*)

.PHONY: all build install uninstall

all: build

build:
	cargo build --release

install:
	@for bin in vfiod vfioctl vfiod-pool; do \
	  test -x $(RELEASE)/$$bin || { echo "make install: $(RELEASE)/$$bin is missing: run 'cargo build --release' first" >&2; exit 1; }; \
	done
	@test -f conf/vfiod.toml || { echo "make install: conf/vfiod.toml is missing" >&2; exit 1; }
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod $(DESTDIR)$(SBINDIR)/vfiod
	$(INSTALL) -D -m 0755 $(RELEASE)/vfioctl $(DESTDIR)$(BINDIR)/vfioctl
	@# The reference pool service and its stand-in driver (docs/pool-protocol.md); no unit: a
	@# pool runs where the operator chooses, usually not on every host.
	$(INSTALL) -D -m 0755 $(RELEASE)/vfiod-pool $(DESTDIR)$(BINDIR)/vfiod-pool
	$(INSTALL) -d -m 0755 $(DESTDIR)$(UNITDIR)
	sed -e 's|/usr/local/sbin/vfiod|$(SBINDIR)/vfiod|' -e 's|/etc/vfiod/|$(CONFDIR)/|g' \
	  systemd/vfiod.service > $(DESTDIR)$(UNITDIR)/vfiod.service
	chmod 0644 $(DESTDIR)$(UNITDIR)/vfiod.service
	$(INSTALL) -D -m 0644 systemd/tmpfiles.d/vfiod.conf $(DESTDIR)$(TMPFILESDIR)/vfiod.conf
	$(INSTALL) -D -m 0644 conf/dbus-1/system.d/org.vfiod.Vfiod1.conf $(DESTDIR)$(DBUS_POLICYDIR)/org.vfiod.Vfiod1.conf
	$(INSTALL) -D -m 0644 polkit/org.vfiod.vfiod1.policy $(DESTDIR)$(POLKIT_ACTIONDIR)/org.vfiod.vfiod1.policy
	$(INSTALL) -d -m 0755 $(DESTDIR)$(CONFDIR) $(DESTDIR)$(CONFDIR)/conf.d
	@# An administrator's configuration is never overwritten.
	@if [ -e $(DESTDIR)$(CONFDIR)/vfiod.toml ]; then \
	  echo "keeping existing $(DESTDIR)$(CONFDIR)/vfiod.toml"; \
	else \
	  echo "$(INSTALL) -m 0644 conf/vfiod.toml $(DESTDIR)$(CONFDIR)/vfiod.toml"; \
	  $(INSTALL) -m 0644 conf/vfiod.toml $(DESTDIR)$(CONFDIR)/vfiod.toml; \
	fi
ifneq ($(HOOKS),)
	$(INSTALL) -d -m 0755 $(DESTDIR)$(HOOKDIR)
	@# The shims exec the vfioctl installed above, wherever BINDIR put it.
	for h in $(HOOKS); do \
	  sed -e 's|/usr/local/bin/vfioctl|$(BINDIR)/vfioctl|' $$h > $(DESTDIR)$(HOOKDIR)/$$(basename $$h) && \
	  chmod 0755 $(DESTDIR)$(HOOKDIR)/$$(basename $$h) || exit 1; \
	done
	@echo "libvirt reads its hook directory when it starts: restart libvirtd (or virtqemud) once"
endif

uninstall:
	rm -f $(DESTDIR)$(SBINDIR)/vfiod $(DESTDIR)$(BINDIR)/vfioctl $(DESTDIR)$(BINDIR)/vfiod-pool
	rm -f $(DESTDIR)$(UNITDIR)/vfiod.service $(DESTDIR)$(TMPFILESDIR)/vfiod.conf
	rm -f $(DESTDIR)$(DBUS_POLICYDIR)/org.vfiod.Vfiod1.conf $(DESTDIR)$(POLKIT_ACTIONDIR)/org.vfiod.vfiod1.policy
	$(if $(HOOKS),rm -f $(addprefix $(DESTDIR)$(HOOKDIR)/,$(notdir $(HOOKS))))
	@echo "left in place: $(DESTDIR)$(CONFDIR) (configuration) and /var/lib/vfiod (state)"
