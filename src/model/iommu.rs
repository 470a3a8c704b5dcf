//! Whether the host has an IOMMU, decided from what sysfs shows: without one, no device can be
//! passed through safely (a device given to a VM could read and write all of the host's memory
//! by DMA), so vfiod binds nothing to vfio-pci, claims and attaches nothing.
//!
//! The kernel shows an IOMMU by its groups: `sys/kernel/iommu_groups/N` and each function's
//! `iommu_group` link. Interrupt remapping (without which an assigned device can inject
//! interrupts into the host) is not decided here: sysfs shows only whether the hardware
//! supports it (the IR bit of `sys/class/iommu/dmar*/intel-iommu/ecap`), not whether the kernel
//! enabled it (`intremap=off`, x2APIC opt-outs), which only the boot log says; and the kernel
//! itself refuses to attach a VFIO group without it unless `vfio_iommu_type1`'s
//! `allow_unsafe_interrupts` is set.

use super::text::text_enum;

/// What the edge read (`host::sysfs::iommu`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IommuFacts {
    /// Entries of `sys/kernel/iommu_groups` (0 when it is absent).
    pub groups: usize,
    /// PCI functions with an `iommu_group` link (read only when there are no groups).
    pub functions_in_a_group: usize,
}

/// The host's IOMMU as vfiod decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Iommu {
    /// IOMMU groups exist: passthrough can be safe.
    Present,
    /// No IOMMU group at all: passthrough is refused.
    Absent,
}

text_enum!(Iommu, Present => "present", Absent => "absent");

/// How to turn the IOMMU on: the fix [`NoIommu`] and `vfioctl doctor` give.
pub const ENABLE_IOMMU: &str =
    "enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on (or amd_iommu=on) iommu=pt";

/// The refusal of any passthrough (a bind to vfio-pci, a claim, an attach) on a host without
/// an IOMMU, with how to turn it on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no IOMMU: passthrough is unsafe; {}", ENABLE_IOMMU)]
pub struct NoIommu;

impl Iommu {
    /// From the facts: present when any group exists or any function sits in one. Pure.
    pub fn decide(facts: IommuFacts) -> Iommu {
        if facts.groups > 0 || facts.functions_in_a_group > 0 {
            Iommu::Present
        } else {
            Iommu::Absent
        }
    }

    /// Whether passthrough may go ahead.
    pub fn passthrough(self) -> Result<(), NoIommu> {
        match self {
            Iommu::Present => Ok(()),
            Iommu::Absent => Err(NoIommu),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_iommu_is_there_when_any_group_is() {
        // (groups, functions in a group, decided)
        let table = [
            (0, 0, Iommu::Absent),
            (12, 30, Iommu::Present),
            (1, 0, Iommu::Present),
            // Groups not listed (a partial or odd tree) but links there: an IOMMU.
            (0, 3, Iommu::Present),
        ];
        for (groups, functions_in_a_group, want) in table {
            let facts = IommuFacts {
                groups,
                functions_in_a_group,
            };
            assert_eq!(Iommu::decide(facts), want, "{facts:?}");
            assert_eq!(want.passthrough().is_ok(), want == Iommu::Present);
        }
        assert_eq!(
            NoIommu.to_string(),
            "no IOMMU: passthrough is unsafe; enable VT-d/AMD-Vi in firmware and boot with \
             intel_iommu=on (or amd_iommu=on) iommu=pt"
        );
    }
}
