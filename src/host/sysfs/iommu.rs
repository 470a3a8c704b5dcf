//! What sysfs shows of the host's IOMMU: its groups, and when there are none, whether any
//! function sits in one ([`crate::model::iommu`] decides). One directory read on a host with an
//! IOMMU.

use super::Sysfs;
use crate::model::iommu::{Iommu, IommuFacts};

/// Reads the facts under the sysfs root.
pub fn read_facts(sysfs: &Sysfs) -> IommuFacts {
    let groups = sysfs
        .backend()
        .read_dir(&sysfs.path("sys/kernel/iommu_groups"))
        .map_or(0, |g| g.len());
    let functions_in_a_group = if groups > 0 {
        0
    } else {
        sysfs
            .list_functions()
            .unwrap_or_default()
            .into_iter()
            .filter(|a| {
                sysfs
                    .backend()
                    .read_link(&sysfs.device_attr(*a, "iommu_group"))
                    .is_ok()
            })
            .count()
    };
    IommuFacts {
        groups,
        functions_in_a_group,
    }
}

/// The host's IOMMU, as decided from what is read now.
pub fn read(sysfs: &Sysfs) -> Iommu {
    Iommu::decide(read_facts(sysfs))
}
