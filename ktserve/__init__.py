"""What both services share: the `ktserve` command, checkpoint and config reading, the generated
gRPC stubs (`ktserve.protocol`), the MoE wire format and the names of dtypes and weight formats."""
