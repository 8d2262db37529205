//! A collective's name as errors give it (its signature, "all_reduce(1024 x float32, sum, #7)"),
//! formatted only when something asks for it: a call that succeeds formats nothing.

use std::cell::OnceCell;
use std::fmt;

use crate::signature::Signature;

/// The name of call `sig`, formatted at most once.
pub(crate) struct OpName<'a> {
    sig: &'a Signature,
    text: OnceCell<String>,
}

impl<'a> OpName<'a> {
    pub(crate) fn new(sig: &'a Signature) -> Self {
        OpName { sig, text: OnceCell::new() }
    }

    /// The name as text, for what takes it so (errors, liveness checks).
    pub(crate) fn as_str(&self) -> &str {
        self.text.get_or_init(|| self.sig.to_string())
    }
}

impl fmt::Display for OpName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::signature::CollKind;

    #[test]
    fn the_name_is_the_signature_as_text() {
        let sig = Signature::new(CollKind::AllReduce, 7, 1024).dtype(DType::F32);
        let name = OpName::new(&sig);
        assert_eq!((name.as_str(), name.to_string()), (sig.to_string().as_str(), sig.to_string()));
    }
}
