//! The harness: proves the engine correct (parity gates against committed goldens and live
//! oracles) and measures it honestly. It depends on the engine, never the reverse, and owns
//! every oracle call.

pub mod compare;
pub mod goldens;
pub mod machine;
pub mod oracle;
pub mod parity;
