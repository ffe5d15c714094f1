"""Tiny segmentation checkpoints, built once per session for every family this environment has."""
import pytest


@pytest.fixture(scope="session")
def seg_checkpoints(tmp_path_factory):
    from AutoXLA import tiny_vision

    root = tmp_path_factory.mktemp("segmentation")
    return {f: tiny_vision.save_tiny_segmentation(f, root / f, seed=i)
            for i, f in enumerate(tiny_vision.available_families())}
