//! How ranks meet: the in-process world (threads) and the waiting primitive the worlds share.

pub(crate) mod mailbox;
pub mod thread;
pub(crate) mod wait;
