"""Two guests on a private link: live migration of a small nested domain from host A to host B."""

from testbed.nested import define_small_domain, migrate
from testbed.runner import Testbed, scenario


# About 2 minutes on 2 cores (two TCG guests at once). Opt-in since 2026-12-02: hooks_migration
# and pool_migration boot the same pair and live-migrate between them by default, and CI's whole
# run came to about 58 of its 60 minutes with this one in it.
@scenario(default=False)
def migration_smoke(tb: Testbed) -> None:
    """hosta and hostb see each other on the private link; a running domain live-migrates A -> B"""
    a, b = tb.boot_pair()
    a.run(f"ping -c 1 -W 5 {b.link.address}")
    assert a.run("ssh hostb hostname").out.strip() == "hostb"
    with tb.timed("domain start on hosta"):
        define_small_domain(a, "small")
    tb.note("virsh migrate --live", migrate(a, b, "small"))
    b.run("virsh destroy small && virsh undefine small")
