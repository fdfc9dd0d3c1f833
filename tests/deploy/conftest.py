"""deploy/tpu_vm.sh against a fake `gcloud` (fake_gcloud.py) first on PATH, in a tmp dir."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from deploy_support import Deploy, install_fake_gcloud  # noqa: E402


@pytest.fixture
def deploy(tmp_path) -> Deploy:
    return install_fake_gcloud(tmp_path)
