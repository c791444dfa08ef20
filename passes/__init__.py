"""Graph passes run between validation and lowering: canonicalisation and fusions into the `mindspore`
domain. One file per pass; importing this package registers the built-in ones; their order is
passes.manager.DEFAULT_ORDER."""

from passes.manager import (DEFAULT_ORDER, PassManager, PassResult, available_passes, load_plugins,  # noqa: F401
                            register_pass, rewrite_pass, skipped_fusions)

from passes import settle_ifs  # noqa: F401
from passes import canonicalize  # noqa: F401
from passes import tie_weights  # noqa: F401
from passes import refine_shapes  # noqa: F401
from passes import fuse_rmsnorm  # noqa: F401
from passes import fuse_layernorm  # noqa: F401
from passes import fuse_gelu  # noqa: F401
from passes import fuse_silu  # noqa: F401
from passes import fuse_swiglu  # noqa: F401
from passes import fuse_rope  # noqa: F401
from passes import fuse_attention  # noqa: F401
from passes import fuse_moe  # noqa: F401
from passes import fuse_lstm  # noqa: F401
from passes import fuse_quant_matmul  # noqa: F401
from passes import fuse_qdq_matmul  # noqa: F401
from passes import coverage  # noqa: F401  (the fusion families and their candidate rules)
