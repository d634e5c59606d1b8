"""A small HTML tree for the console's tests (no parser dependency): find elements by
id, tag and attributes, read their text and attributes, as the browser would."""

from __future__ import annotations

from html.parser import HTMLParser

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}


class Node:
    def __init__(self, tag: str, attrs: dict[str, str | None], parent: Node | None) -> None:
        self.tag = tag
        self.attrs = attrs
        self.parent = parent
        self.children: list[Node | str] = []

    def __repr__(self) -> str:
        return f"<{self.tag} {self.attrs}>"

    @property
    def text(self) -> str:
        """The text inside, whitespace collapsed (what a person reads)."""
        parts: list[str] = []

        def walk(node: Node) -> None:
            for child in node.children:
                if isinstance(child, str):
                    parts.append(child)
                else:
                    walk(child)

        walk(self)
        return " ".join("".join(parts).split())

    def get(self, name: str) -> str | None:
        return self.attrs.get(name)

    def iter(self) -> list[Node]:
        found: list[Node] = []
        for child in self.children:
            if isinstance(child, Node):
                found.append(child)
                found.extend(child.iter())
        return found

    def all(self, tag: str | None = None, **attrs: str) -> list[Node]:
        """Elements under this one with ``tag`` (any when None) and these attribute
        values (``class_`` for class: one of its words)."""
        found = []
        for node in self.iter():
            if tag is not None and node.tag != tag:
                continue
            ok = True
            for key, want in attrs.items():
                name = key.rstrip("_").replace("_", "-")
                have = node.attrs.get(name)
                if name == "class":
                    ok = ok and have is not None and want in have.split()
                else:
                    ok = ok and have == want
            if ok:
                found.append(node)
        return found

    def one(self, tag: str | None = None, **attrs: str) -> Node:
        found = self.all(tag, **attrs)
        assert len(found) == 1, f"{len(found)} elements {tag} {attrs}"
        return found[0]

    def by_id(self, ident: str) -> Node:
        return self.one(id=ident)

    def has(self, tag: str | None = None, **attrs: str) -> bool:
        return bool(self.all(tag, **attrs))


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {}, None)
        self.at = self.root

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, dict(attrs), self.at)
        self.at.children.append(node)
        if tag not in VOID:
            self.at = node

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.at.children.append(Node(tag, dict(attrs), self.at))

    def handle_endtag(self, tag: str) -> None:
        node: Node | None = self.at
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.at = node.parent

    def handle_data(self, data: str) -> None:
        self.at.children.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root
