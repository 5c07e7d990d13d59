"""Optional dependencies (extras tensorboard, plot, parquet, arrayrecord): a missing one is named with its extra,
and what does not need it keeps working."""

import sys

import pytest

from dsv32_jax.optional import require
from dsv32_jax.train import data as data_lib
from dsv32_jax.train.plot import plot


def hide(monkeypatch, *modules):
    for name in modules:  # a None entry makes `import name` raise ImportError
        monkeypatch.setitem(sys.modules, name, None)


def test_require_names_the_feature_and_the_extra(monkeypatch):
    hide(monkeypatch, "pyarrow")
    with pytest.raises(ImportError, match=r"data.source='parquet' needs .*'pyarrow'.*pip install 'dsv32-jax\[parquet\]'"):
        require("pyarrow", "parquet", "data.source='parquet'")
    assert require("json", "none", "x").dumps(1) == "1"


@pytest.mark.parametrize("source, module, extra", [("parquet", "pyarrow", "parquet"),
                                                   ("arrayrecord", "array_record", "arrayrecord")])
def test_data_sources_name_their_extra(monkeypatch, tmp_path, source, module, extra):
    path = tmp_path / ("docs.parquet" if source == "parquet" else "docs.array_record")
    path.write_bytes(b"not read")
    hide(monkeypatch, module, module + ".parquet", module + ".python", module + ".python.array_record_module",
         module + ".python.array_record_data_source")
    cfg = data_lib.DataConfig(source=source, paths=(str(path),), seq_len=16, batch_size=2)
    with pytest.raises(ImportError, match=rf"data.source='{source}' needs .*pip install 'dsv32-jax\[{extra}\]'"):
        data_lib.make_iterator(cfg, vocab_size=300)


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    hide(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with pytest.raises(ImportError, match=r"pip install 'dsv32-jax\[plot\]'"):
        plot({"run": [{"step": 1, "loss": 1.0}]}, str(tmp_path / "c.png"))
