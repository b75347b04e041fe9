"""Token trees only where every stage's side rows are exact on its machine
(orchestrator.decoding.drafting.exact_trees; each stage measures its own,
stages.tree_check): elsewhere chains, said on the status line."""

from orchestrator.decoding.drafting import SpeculationSettings, exact_trees


def test_trees_become_chains_where_a_stage_computes_side_rows_inexactly_and_the_run_says_so():
    trees = SpeculationSettings("ngram", tree_leaves=4)
    said: list[str] = []
    assert exact_trees(trees, [], said.append) is trees
    assert exact_trees(SpeculationSettings("ngram"), [1], said.append).tree_leaves == 1
    assert said == []  # nothing to say: no trees asked for, or every stage exact
    chains = exact_trees(trees, [0, 1], said.append)
    assert chains.tree_leaves == 1 and chains.speculator == "ngram"
    assert said == ["[token trees off: a side row's output differs from its path's on the machine of stage 0, 1 "
                    "(llama.cpp's kernels there), so trees could change the text; drafting chains]"]
