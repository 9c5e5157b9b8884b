"""Start-up of federated processes: the compile cache setting, and a second process loading
the first one's compiled training step from the shared folder instead of compiling it."""

from __future__ import annotations

import os
import subprocess
import sys

from tandem.parties.fl.startup import cache_folder

STEP = """
import sys
from tandem.parties.fl.startup import enable_compilation_cache
import numpy as np
folder = enable_compilation_cache(sys.argv[1])
from tandem.parties.fl.train import LocalTrainer
import optax
trainer = LocalTrainer([8, 16, 3], optax.sgd(0.1), epochs=1, batch_size=16)
x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
y = (np.arange(64) % 3).astype(np.int32)
trainer.train(trainer.init_vec, x, y, 0)
print(folder)
"""


def test_cache_folder_rules(monkeypatch, tmp_path):
    assert cache_folder("off") is None
    assert cache_folder(str(tmp_path / "c")) == str(tmp_path / "c")
    monkeypatch.setenv("TANDEM_COMPILE_CACHE", str(tmp_path / "env"))
    assert cache_folder("auto") == str(tmp_path / "env")
    monkeypatch.setenv("TANDEM_COMPILE_CACHE", "off")
    assert cache_folder("auto") is None
    monkeypatch.delenv("TANDEM_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_folder("auto") == str(tmp_path / "xdg" / "tandem" / "jax")


def test_a_second_process_reuses_the_first_ones_compiled_step(tmp_path):
    folder = tmp_path / "jax"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def run() -> set[str]:
        out = subprocess.run(
            [sys.executable, "-c", STEP, str(folder)], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == str(folder)
        return set(os.listdir(folder))

    first = run()
    assert first  # the training step was written
    assert run() == first  # and found again: nothing new compiled


def test_training_leaves_its_input_alone_with_donated_buffers():
    """The step donates the parameters' buffers: neither the caller's vector nor a state that
    holds the parameters (here twice) may share them, and the result is sgd's."""
    import jax
    import numpy as np
    import optax

    from tandem.parties.fl.train import LocalTrainer

    def keeps(params):
        return {"slow": params, "again": params}

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(lambda g: -0.1 * g, grads), state

    x = np.random.default_rng(0).normal(size=(50, 8)).astype(np.float32)
    y = (np.arange(50) % 3).astype(np.int32)
    holding = LocalTrainer([8, 16, 3], optax.GradientTransformation(keeps, update), batch_size=16)
    plain = LocalTrainer([8, 16, 3], optax.sgd(0.1), batch_size=16)
    vec = holding.init_vec.copy()
    first = holding.train(vec, x, y, 0)
    assert np.array_equal(vec, holding.init_vec)  # the input is untouched
    assert np.array_equal(first, holding.train(vec, x, y, 0))
    assert np.array_equal(first, plain.train(plain.init_vec, x, y, 0))
    assert holding.traces == 1


def test_the_initial_parameters_are_the_models_draw():
    import jax
    import numpy as np
    import optax

    from tandem.engine.kernels import mlp_stage
    from tandem.parties.fl.compression import flatten
    from tandem.parties.fl.train import LocalTrainer

    model = mlp_stage([8], [16], 3, activate_last=False)
    trainer = LocalTrainer(model, optax.sgd(0.1), init_seed=5)
    eager, spec = flatten(model.init(jax.random.key(5)))
    assert trainer.spec == spec and trainer.init_vec.dtype == np.float32
    np.testing.assert_allclose(trainer.init_vec, eager, rtol=1e-6, atol=1e-7)


def test_the_warm_up_compiles_the_step_once_and_changes_no_result():
    import numpy as np
    import optax

    from tandem.parties.fl.train import LocalTrainer

    x = np.random.default_rng(1).normal(size=(40, 8)).astype(np.float32)
    y = (np.arange(40) % 3).astype(np.int32)
    warmed = LocalTrainer([8, 16, 3], optax.adam(0.01), batch_size=16)
    cold = LocalTrainer([8, 16, 3], optax.adam(0.01), batch_size=16)
    warmed.warm_up(x, y)
    assert warmed.traces == 1
    assert not warmed.init_vec.flags.writeable  # a view: whoever keeps a model copies it
    np.testing.assert_array_equal(
        warmed.train(warmed.init_vec, x, y, 3), cold.train(cold.init_vec, x, y, 3)
    )
    assert warmed.traces == 1  # training found the warmed-up step


ARROW_POOL = """
import sys
if sys.argv[1] == "used":
    import pyarrow
    pyarrow.array([1, 2, 3])  # its default pool is made here
from tandem.parties.fl.startup import use_system_arrow_pool
print(use_system_arrow_pool())
import pyarrow as pa
print(pa.default_memory_pool().backend_name)
"""


def test_a_federated_process_allocates_arrow_memory_with_malloc_unless_told_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}

    def pool(when: str, **extra: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-c", ARROW_POOL, when],
            env={**env, **extra},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    assert pool("later") == ["system", "system"]
    assert pool("used") == ["system", "system"]  # switched after pyarrow's first allocation
    chosen = pool("later", ARROW_DEFAULT_MEMORY_POOL="mimalloc")
    assert chosen == ["mimalloc", "mimalloc"]  # the user's choice stands
