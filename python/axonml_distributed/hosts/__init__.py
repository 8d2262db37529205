"""Jobs over several hosts: which ranks share a host (`layout`), and the two-level all_reduce written once
for every engine between hosts (`two_level`). The torch backend ("axonml", `axonml_distributed.torch.hosts`)
and the MPI backend build their groups from these."""
