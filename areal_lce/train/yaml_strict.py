"""The YAML loader of the job configs: PyYAML's safe loader with the rules a config needs.

    data = yaml_load(text_or_open_file)   # raises yaml.YAMLError (DocumentShapeError for the shape rules)

Beyond yaml.SafeLoader: a key given twice in one mapping is an error naming the key and both lines
(PyYAML would keep the last silently); booleans are YAML 1.2's `true` / `false` only (YAML 1.1's `yes`,
`no`, `on`, `off` stay strings, which a bool option refuses); a document may expand to at most MAX_NODES
nodes, each alias counted as the nodes it repeats, and a recursive alias is refused. Anchors and merge
keys (`<<: *base`) work as in PyYAML; an alias bomb -- a few hundred bytes of aliases nested in aliases
that expand to billions of nodes once copied (dataclasses.asdict, a YAML dump of the config) -- is
refused at load, in time linear in the document's distinct nodes.
"""
from __future__ import annotations

import re

import yaml

MAX_NODES = 100_000  # expanded nodes of one YAML document (the shipped configs have a few hundred)
_BOOL_TAG = "tag:yaml.org,2002:bool"


class DocumentShapeError(yaml.constructor.ConstructorError):
    """A well-formed YAML document refused for its shape: too large once its aliases are expanded, or
    recursive."""


class StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key repeated within one mapping (merge keys `<<` may be overridden),
    reads only true/false as booleans (YAML 1.2) and refuses a document whose aliases expand it past
    MAX_NODES nodes or into a cycle."""

    def construct_document(self, node):
        check_expanded_size(node)  # before anything is built from it
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    line = first.get(key)
                except TypeError:  # unhashable key: the base class reports it
                    continue
                if line is not None:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"duplicate key {key!r} (first given on line {line}); a repeated key or section would "
                        "silently replace the first one", key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


# YAML 1.2 booleans: PyYAML's 1.1 resolver also turns yes/no/on/off (any case) into booleans.
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
StrictLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def check_expanded_size(root, limit: int = MAX_NODES) -> int:
    """The node count of the composed YAML document `root` with every alias expanded (the size of what
    is built from it once copied, e.g. by dataclasses.asdict or a YAML dump); raises
    DocumentShapeError at the first node past `limit` or at a recursive alias. Linear in
    the distinct nodes: each node's expanded size is computed once."""
    sizes: dict = {}
    open_nodes: set = set()

    def size(node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise DocumentShapeError(
                None, None, "an alias refers to a node that contains it (a recursive structure); a config "
                "must be a tree", node.start_mark)
        open_nodes.add(key)
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = node.value
        else:
            children = ()
        n = 1 + sum(size(child) for child in children)
        open_nodes.discard(key)
        if n > limit:
            raise DocumentShapeError(
                None, None, f"with its aliases expanded, the node starting here holds {n} nodes, more than "
                f"the {limit} a config may hold (aliases nested in aliases multiply: an alias bomb?)",
                node.start_mark)
        sizes[key] = n
        return n

    return size(root)


def yaml_load(stream):
    """Parse YAML (text or an open file, whose name then appears in errors) with StrictLoader; raises
    yaml.YAMLError on bad syntax, a duplicate key, a document too large once its aliases are expanded,
    or one nested too deeply for the parser."""
    try:
        return yaml.load(stream, Loader=StrictLoader)
    except RecursionError:
        raise yaml.YAMLError("the document is nested too deeply") from None
