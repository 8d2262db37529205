"""Jobs over several hosts: which ranks share a host (`layout`), which host an address in an engine's
error is (`addresses`), a group of one host's world whose errors name the job's ranks (`host_group`),
and the two-level all_reduce written once for every engine between hosts (`two_level`). The torch
backend ("axonml", `axonml_distributed.torch.hosts`) and the MPI backend build their groups from these."""
