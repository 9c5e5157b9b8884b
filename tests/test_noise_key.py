"""A party's secret noise key beside its checkpoints (`tandem.parties.split.process.noise_key`):
the same job resumed draws the same noise, another job other noise, ``--fresh`` a new key;
the file is the party's alone (mode 0600) and never made where no defense draws noise."""

from __future__ import annotations

import os
import stat

import pytest

from tandem.parties.privacy.config import Privacy
from tandem.parties.split.checkpoint import CheckpointError
from tandem.parties.split.process import noise_key

LABEL_DP = Privacy.model_validate({"label_dp": {"epsilon": 2.0}})


def test_the_same_job_gets_the_same_seed_another_job_or_party_another(tmp_path):
    folder = str(tmp_path / "ckpt")
    first = noise_key.noise_seed(folder, "bank", "a" * 64)
    assert noise_key.noise_seed(folder, "bank", "a" * 64) == first  # a resume
    assert noise_key.noise_seed(folder, "bank", "b" * 64) != first  # another spec
    assert noise_key.noise_seed(folder, "shop", "a" * 64) != first  # another party's key
    mode = os.stat(noise_key.key_path(folder, "bank")).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert 0 <= first < 2**64


def test_fresh_discards_the_key_so_the_job_draws_new_noise(tmp_path):
    folder = str(tmp_path)
    first = noise_key.noise_seed(folder, "bank", "a" * 64)
    noise_key.discard(folder, "bank")
    noise_key.discard(folder, "bank")  # (nothing left to delete: no error)
    assert noise_key.noise_seed(folder, "bank", "a" * 64) != first


def test_a_file_that_holds_no_key_is_refused_naming_it(tmp_path):
    path = tmp_path / f"bank{noise_key.SUFFIX}"
    path.write_text("not a key\n")
    with pytest.raises(CheckpointError) as info:
        noise_key.noise_seed(str(tmp_path), "bank", "a" * 64)
    assert str(path) in str(info.value) and "--fresh" in str(info.value)


def test_party_privacy_keys_only_defenses_that_draw_noise_without_a_seed_of_their_own(tmp_path):
    folder = str(tmp_path)
    keyed = noise_key.party_privacy(LABEL_DP, folder, "bank", "a" * 64)
    assert keyed.noise_seed == noise_key.noise_seed(folder, "bank", "a" * 64)
    assert keyed.label_dp == LABEL_DP.label_dp
    own = LABEL_DP.model_copy(update={"noise_seed": 7})
    assert noise_key.party_privacy(own, folder, "bank", "a" * 64).noise_seed == 7
    assert noise_key.party_privacy(LABEL_DP, None, "bank", "a" * 64).noise_seed is None
    off = Privacy.model_validate({"nopeek": {"weight": 0.1}})  # draws no noise
    assert noise_key.party_privacy(off, folder, "shop", "a" * 64) is off
    assert not os.path.exists(noise_key.key_path(folder, "shop"))
