"""kwarm's no-op Triton kernel: one tiny compile and launch at the end of replay pays the
one-time costs of the first launch in a process (the binder's specialization imports, the
launcher), so that the first real kernel launch costs what the second does."""
import triton


@triton.jit
def kwarm_noop(x_ptr):
    pass
