//! `org.vfiod.Vfiod1.Claim`: one object per active claim at `/org/vfiod/Vfiod1/claim/N`. It
//! appears when the claim is made (InterfacesAdded) and goes when it is released
//! (PropertiesChanged to `released`, then InterfacesRemoved); `Manager.GetClaims` lists them.

use super::auth::{Check, Detail, ACTION_CLAIM};
use super::error::Error;
use crate::store::ClaimRecord;
use std::collections::HashMap;
use zbus::{interface, OwnedObjectPath, OwnedVariant};

pub const INTERFACE: &str = "org.vfiod.Vfiod1.Claim";

pub fn claim_path(id: i64) -> OwnedObjectPath {
    OwnedObjectPath::try_from(format!("{}/claim/{id}", super::ROOT_PATH))
        .expect("valid object path")
}

/// The D-Bus face of one claim: its id and the view it reads from.
pub struct ClaimObject {
    pub id: i64,
    pub objects: super::Objects,
}

impl ClaimObject {
    /// Asks polkit whether the caller may take `verb` on this claim (`org.vfiod.vfiod1.claim`,
    /// with the device, the VM (`vm`, else the claim's) and the kind); returns who asked.
    async fn authorize(
        &self,
        verb: &'static str,
        vm: Option<&str>,
        header: &zbus::message::Header<'_>,
        conn: &zbus::Connection,
    ) -> Result<String, Error> {
        let claim = self
            .claim()
            .map_err(|_| Error::NoSuchClaim(format!("no claim {}", self.id)))?;
        let o = &self.objects;
        let check = Check::on_device(ACTION_CLAIM, verb, claim.address)
            .with(Detail::Vm, vm.unwrap_or(claim.vm()))
            .with(Detail::Kind, claim.kind.map_or("", |k| k.as_str()));
        o.authorizer.check(conn, header, &check).await?;
        Ok(o.requesters.of(conn, header).await)
    }

    fn claim(&self) -> zbus::fdo::Result<ClaimRecord> {
        self.objects
            .view
            .claim(self.id)
            .ok_or_else(|| zbus::fdo::Error::UnknownObject(format!("no claim {}", self.id)))
    }
}

pub fn properties(c: &ClaimRecord) -> Vec<(&'static str, OwnedVariant)> {
    use super::variant as v;
    vec![
        ("Id", v(c.id)),
        ("Device", v(super::device_path(c.address))),
        ("Address", v(c.address.to_string())),
        (
            "Functions",
            v(c.functions
                .iter()
                .map(|a| a.to_string())
                .collect::<Vec<_>>()),
        ),
        ("VmName", v(c.vm_name.clone().unwrap_or_default())),
        ("VmUuid", v(c.vm_uuid.clone().unwrap_or_default())),
        ("Kind", v(c.kind.map_or("", |k| k.as_str()))),
        ("State", v(c.state.as_str())),
        (
            "GuestAddress",
            v(c.guest_address.clone().unwrap_or_default()),
        ),
        ("Created", v(c.created_ms.max(0))),
        ("LeaseExpires", v(c.lease_expires_ms.unwrap_or(0).max(0))),
        ("Persistent", v(c.persistent)),
        ("RequestedBy", v(c.requested_by.clone())),
    ]
}

pub fn changed_properties(
    old: &ClaimRecord,
    new: &ClaimRecord,
) -> HashMap<&'static str, OwnedVariant> {
    super::changed(properties(old), properties(new))
}

#[interface(name = "org.vfiod.Vfiod1.Claim")]
impl ClaimObject {
    #[zbus(property(emits_changed_signal = "const"))]
    fn id(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.id)
    }
    /// The claimed device's object.
    #[zbus(property(emits_changed_signal = "const"))]
    fn device(&self) -> zbus::fdo::Result<OwnedObjectPath> {
        Ok(super::device_path(self.claim()?.address))
    }
    /// The claimed device's PCI address.
    #[zbus(property(emits_changed_signal = "const"))]
    fn address(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.address.to_string())
    }
    /// Every host function the claim holds: the device, then its IOMMU group-mates (a GPU's
    /// audio function).
    #[zbus(property(emits_changed_signal = "const"))]
    fn functions(&self) -> zbus::fdo::Result<Vec<String>> {
        Ok(self
            .claim()?
            .functions
            .iter()
            .map(|a| a.to_string())
            .collect())
    }
    #[zbus(property)]
    fn vm_name(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.vm_name.unwrap_or_default())
    }
    #[zbus(property)]
    fn vm_uuid(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.vm_uuid.unwrap_or_default())
    }
    /// The claimed device's kind (gpu, fpga, crypto, nvme, nic, other) when it was claimed.
    #[zbus(property(emits_changed_signal = "const"))]
    fn kind(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.kind.map_or("", |k| k.as_str()).into())
    }
    /// claimed, attaching, attached, detaching, released.
    #[zbus(property)]
    fn state(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.state.as_str().into())
    }
    /// The device's address in the guest, read back from the live domain XML once attached;
    /// empty until then.
    #[zbus(property)]
    fn guest_address(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.guest_address.unwrap_or_default())
    }
    /// Unix milliseconds.
    #[zbus(property(emits_changed_signal = "const"))]
    fn created(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.created_ms.max(0))
    }
    /// When an unattached claim lapses, Unix milliseconds; 0 for no lease.
    #[zbus(property)]
    fn lease_expires(&self) -> zbus::fdo::Result<i64> {
        Ok(self.claim()?.lease_expires_ms.unwrap_or(0).max(0))
    }
    /// Whether the claim outlives the VM's run.
    #[zbus(property)]
    fn persistent(&self) -> zbus::fdo::Result<bool> {
        Ok(self.claim()?.persistent)
    }
    /// Who made the claim: a uid or a D-Bus sender.
    #[zbus(property(emits_changed_signal = "const"))]
    fn requested_by(&self) -> zbus::fdo::Result<String> {
        Ok(self.claim()?.requested_by)
    }

    /// Attaches the claim's functions to libvirt domain `domain` (a name or UUID; the claim's VM)
    /// as `<hostdev managed='no'>`, after binding them to vfio-pci, and returns when done (as a
    /// task on the device meanwhile). Options: `live` b, `config` b (attach to the running
    /// domain, to its persistent configuration); neither means both when the domain runs,
    /// `config` when it does not. A failure releases the claim: `AttachFailed` with libvirt's
    /// message. Authorized as `org.vfiod.vfiod1.claim` with the device and the VM.
    async fn attach(
        &self,
        domain: String,
        options: super::wire::Dict,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<(), Error> {
        let flags = attach_flags(options)?;
        let who = self
            .authorize("Attach", Some(&domain), &header, conn)
            .await?;
        let o = &self.objects;
        let outcome = o.engine.attach_claim(self.id, &domain, flags, &who).await;
        o.engine.flush().await;
        outcome.map(drop).map_err(Error::from)
    }

    /// Takes the claim's functions out of its domain and returns when the guest has let go
    /// (libvirt's device-removed event), at most `[claims] detach_timeout` (30 s by default: a
    /// caller's method timeout must be longer). Success ends the claim. `DetachFailed` when
    /// libvirt or the guest refused, or the guest did not let go in time: the claim stays, and
    /// a late device-removed event still completes it. Authorized as `org.vfiod.vfiod1.claim`.
    async fn detach(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<(), Error> {
        let who = self.authorize("Detach", None, &header, conn).await?;
        let o = &self.objects;
        let outcome = o.engine.detach_claim(self.id, &who).await;
        o.engine.flush().await;
        outcome.map(drop).map_err(Error::from)
    }

    /// Gives the claim up: its functions return to the pool and this object goes. Authorized as
    /// `org.vfiod.vfiod1.claim` with the device and the VM.
    async fn release(
        &self,
        #[zbus(header)] header: zbus::message::Header<'_>,
        #[zbus(connection)] conn: &zbus::Connection,
    ) -> Result<(), Error> {
        let who = self.authorize("Release", None, &header, conn).await?;
        let o = &self.objects;
        o.engine
            .release_claim(self.id, &who, "Claim.Release")
            .await?;
        o.engine.flush().await;
        Ok(())
    }
}

/// The options `Claim.Attach` takes.
pub const ATTACH_OPTIONS: &[&str] = &["live", "config"];

/// `Claim.Attach`'s options as the engine's flags. Neither given: none (the engine picks from
/// the domain's state). One given: it says yes or no to its own target and the other target is
/// the opposite (`live: false` alone is a config-only attach). Both false ask for nothing:
/// refused.
fn attach_flags(options: super::wire::Dict) -> Result<Vec<String>, Error> {
    let q = super::wire::Query::new(options, ATTACH_OPTIONS)?;
    flags_of(q.bool("live")?, q.bool("config")?)
}

fn flags_of(live: Option<bool>, config: Option<bool>) -> Result<Vec<String>, Error> {
    if live.is_none() && config.is_none() {
        return Ok(Vec::new());
    }
    let live = live.unwrap_or(config == Some(false));
    let config = config.unwrap_or(!live);
    if !live && !config {
        return Err(Error::InvalidArgument(
            "live and config are both false: nothing to attach to".into(),
        ));
    }
    Ok([("live", live), ("config", config)]
        .into_iter()
        .filter(|(_, set)| *set)
        .map(|(flag, _)| flag.to_string())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::flags_of;

    #[test]
    fn attach_options_become_the_engines_flags() {
        let (t, f) = (Some(true), Some(false));
        // live, config -> the flags, or None when refused.
        type Row = (Option<bool>, Option<bool>, Option<&'static [&'static str]>);
        let table: &[Row] = &[
            (None, None, Some(&[])),
            (t, None, Some(&["live"])),
            (f, None, Some(&["config"])),
            (None, t, Some(&["config"])),
            (None, f, Some(&["live"])),
            (t, t, Some(&["live", "config"])),
            (t, f, Some(&["live"])),
            (f, t, Some(&["config"])),
            (f, f, None),
        ];
        for (live, config, want) in table {
            let got = flags_of(*live, *config).ok();
            let want = want.map(|w| w.iter().map(|s| s.to_string()).collect::<Vec<_>>());
            assert_eq!(got, want, "live {live:?} config {config:?}");
        }
    }
}
