"""`ggx graph` writes a DOT file of a scheduled graph: nodes colored by backend, splits boxed."""
from ggx.cli import main


def test_graph_command_writes_dot(tmp_path, capsys):
    out = tmp_path / "g.dot"
    assert main(["graph", "-o", str(out), "-d", "ref", "--layers", "1"]) == 0
    text = out.read_text()
    assert text.startswith("digraph")
    assert "cluster" in text  # splits are boxed as clusters
    assert "mul_mat" in text.lower() and "fillcolor" in text
