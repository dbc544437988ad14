//! MXFP8 (OCP microscaling): the E4M3/E8M0 codec, scale algorithms and layouts, as pure
//! functions. This is the specification every backend must match bit for bit.
