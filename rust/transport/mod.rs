//! How ranks meet: the in-process world (threads), the multi-process world (shared memory), and the
//! waiting primitive they share.

pub(crate) mod mailbox;
pub mod shm;
pub mod thread;
pub(crate) mod wait;
