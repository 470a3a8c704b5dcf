//! FPGA images and programming decisions, as pure code: the image headers vfiod reads
//! (`image`), and what makes an image legal for a device and what a verify concludes
//! (`program`).

pub mod image;
pub mod program;
