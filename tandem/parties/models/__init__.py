"""Stage models shared by split learning, federated learning and elastic training.

The contract is `tandem.engine.kernels.StageModel`: ``init(key) -> params`` (a pytree of
arrays), ``apply(params, *inputs) -> [batch, out_dim]``, the input and output widths, and a JSON
``spec`` that `model_from_spec` turns back into the same model (what exports record).

* built-ins: `mlp`, `embedding_mlp` (categorical columns);
* adapters: `from_functions`, `from_flax_linen`, `from_flax_nnx`, `from_equinox`;
* user factories by import path: `load_factory` (``"package.module:function"`` + kwargs);
* from data: `model_from_spec` (an export's spec), `model_from_toml` (a stage's TOML table).

docs/models.md shows each with an example. Flax and Equinox are optional extras, imported
only when their adapter is called.
"""

from tandem.engine.kernels import StageModel

from .adapters import from_equinox, from_flax_linen, from_flax_nnx, from_functions
from .builtin import embedding_mlp, mlp
from .factory import factory_spec, load_factory
from .spec import model_from_spec, model_from_toml

__all__ = [
    "StageModel",
    "mlp",
    "embedding_mlp",
    "from_functions",
    "from_flax_linen",
    "from_flax_nnx",
    "from_equinox",
    "load_factory",
    "factory_spec",
    "model_from_spec",
    "model_from_toml",
]
