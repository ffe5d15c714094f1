"""Tiny segmentation checkpoints, built once per session for every family this environment has."""
import pytest


@pytest.fixture(scope="session")
def seg_checkpoints(tmp_path_factory):
    from AutoXLA.testing import tiny_vision

    root = tmp_path_factory.mktemp("segmentation")
    return {f: tiny_vision.save_tiny_segmentation(f, root / f, seed=i)
            for i, f in enumerate(tiny_vision.available_families())}


@pytest.fixture(scope="session")
def sam3_detector_checkpoint(tmp_path_factory):
    """The tiny SAM 3 text-prompted detector (Sam3Model), saved once per session."""
    from AutoXLA.testing import tiny_vision

    return tiny_vision.save_tiny_sam3_detector(tmp_path_factory.mktemp("sam3_detector"), seed=7)
