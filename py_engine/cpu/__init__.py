"""Ring 1: the CPU fast path, applied to an unchanged model as transforms (py_engine.kernels underneath).

    from py_engine.cpu import optimize_for_cpu, kernel_step, model_kernels
    optimize_for_cpu(model)              # ["fuse_projections", "cpu_kernels", "cpu_layers"] where they fit
    with kernel_step(model_kernels(model)):
        logits = model(input_ids, positions, kv)

linears (FusedLinear, KernelLinear) <- layers (norm, attention, MLP in C)
<- stack (a whole decode step in one C call) <- transforms (what installs
them): each module imports only those before it.
"""
from .transforms import kernel_step, model_kernels, optimize_for_cpu, row_invariance_problem

__all__ = ["kernel_step", "model_kernels", "optimize_for_cpu", "row_invariance_problem"]
