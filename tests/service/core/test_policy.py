"""Which path references a server with allowed roots reads."""

import pytest

from service.core.policy import ReferencePolicy
from service.errors import PermissionDenied


def test_a_link_inside_a_linked_folder_may_not_lead_out_of_the_roots(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "model").mkdir(parents=True)
    (root / "other").mkdir()
    outside.mkdir()
    (outside / "secret").write_text("secret")
    (root / "model" / "config.json").write_text("{}")
    (root / "model" / "sub").symlink_to(root / "other")  # inside the roots itself
    (root / "other" / "key.txt").symlink_to(outside / "secret")  # but what it holds leads out
    (root / "other" / "loop").symlink_to(root / "model")  # and a cycle is walked once
    policy = ReferencePolicy.of(roots=(str(root),))
    with pytest.raises(PermissionDenied, match=r"key\.txt"):
        policy.check_path(str(root / "model"), "model", "model")
    (root / "other" / "key.txt").unlink()
    (root / "other" / "key.txt").write_text("fine")
    assert policy.check_path(str(root / "model"), "model", "model") == (root / "model").resolve()
