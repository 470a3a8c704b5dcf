"""vfiod's VM test bed: guest image, guests (QEMU with an emulated IOMMU and SR-IOV NVMe), scenarios runner."""
