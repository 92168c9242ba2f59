"""The static check finds the host copies where they are, and only in the listed functions."""

import textwrap

import pytest

from dlrm.bench.host_copies import HostCopy, host_copies


def test_static_check_lists_the_known_host_copies():
    sites = {(s.module, s.function, s.call) for s in host_copies()}
    known = {
        ("compression.format", "_crc32", "cpu"),  # the payload checksum copies every payload
        ("compression.format", "_crc32", "numpy"),
        ("compression.dedup", "_unique", "numpy"),  # numpy's sort on CPU tensors
        ("compression.dedup", "mismatched_blocks", "numpy"),
        ("dlrm.embedding_comm.ids", "chunk_ids_of", "tolist"),  # which chunks are single-valued
    }
    assert known <= sites


def test_static_check_walks_only_the_listed_functions(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        textwrap.dedent(
            """\
            def hot(t):
                def inner():
                    return t.numpy()
                n = t.tolist
                return inner(), n

            class Codec:
                def encode(self, t):
                    return t.cpu().tolist()

            def cold(t):
                return t.numpy()
            """
        )
    )
    found = host_copies({"pkg.mod": ("hot", "Codec.encode")}, root=tmp_path)
    assert found == [
        HostCopy("pkg.mod", "hot", 3, "numpy"),
        HostCopy("pkg.mod", "Codec.encode", 9, "tolist"),
        HostCopy("pkg.mod", "Codec.encode", 9, "cpu"),
    ]
    assert str(found[0]) == "pkg.mod:hot:3 .numpy()"
    assert len(host_copies({"pkg.mod": None}, root=tmp_path)) == 4
    with pytest.raises(ValueError, match=r"\['warm'\] in 'pkg\.mod'"):
        host_copies({"pkg.mod": ("hot", "warm")}, root=tmp_path)
    with pytest.raises(ValueError, match=r"'pkg\.gone'"):
        host_copies({"pkg.gone": None}, root=tmp_path)
