#![forbid(unsafe_code)]
//! placeholder
