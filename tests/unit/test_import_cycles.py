"""No import cycles among paramserver's modules (imports for type checking only do not count)."""

import grimp
import networkx as nx


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("paramserver", include_external_packages=False, exclude_type_checking_imports=True)
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if not module.startswith(imported + "."):  # a package's own __init__ is no cycle
                edges.add_edge(module, imported)
    cycles = [sorted(group) for group in nx.strongly_connected_components(edges) if len(group) > 1]
    assert cycles == []
