"""Model names: a run directory means its export."""
import pytest

from toolrl.models import resolve_run_model


def test_run_directory_means_its_export(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}")
    assert resolve_run_model(str(tmp_path)) == str(tmp_path / "export")
    assert resolve_run_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    with pytest.raises(FileNotFoundError, match="run directory"):
        resolve_run_model(str(tmp_path.parent))
