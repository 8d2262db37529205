#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| axonml_distributed::fuzzing::verdict(data));
