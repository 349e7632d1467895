//! One module per subcommand.

pub mod key;
pub mod manifest;
pub mod run;
