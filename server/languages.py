"""Tree-sitter grammars, from the per-language wheels (nothing is downloaded at run time).

A language id (LSP's `languageId`, or guessed from the file's extension) maps to a grammar and to the few node
types the context builder needs: what is an import, what is a definition with a header, what is a block. Any other
language gets `None` and the plain-text fallback.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from pathlib import PurePosixPath

from tree_sitter import Language, Parser


@dataclass(frozen=True)
class Grammar:
    name: str
    module: str  # the wheel's module
    function: str  # its function returning the language pointer
    imports: frozenset[str]  # top-level node types that belong to the file's header (imports, package...)
    definitions: frozenset[str]  # nodes whose header (up to the body) stays in the prefix window
    blocks: frozenset[str]  # nodes whose end bounds the suffix window


_C_LIKE_BLOCKS = frozenset({"compound_statement", "field_declaration_list", "declaration_list"})
GRAMMARS: dict[str, Grammar] = {
    g.name: g
    for g in (
        Grammar(
            "python",
            "tree_sitter_python",
            "language",
            frozenset({"import_statement", "import_from_statement", "future_import_statement"}),
            frozenset({"function_definition", "class_definition", "decorated_definition"}),
            frozenset({"block"}),
        ),
        Grammar(
            "javascript",
            "tree_sitter_javascript",
            "language",
            frozenset({"import_statement"}),
            frozenset(
                {"function_declaration", "class_declaration", "method_definition", "generator_function_declaration"}
            ),
            frozenset({"statement_block", "class_body"}),
        ),
        Grammar(
            "typescript",
            "tree_sitter_typescript",
            "language_typescript",
            frozenset({"import_statement"}),
            frozenset({"function_declaration", "class_declaration", "method_definition", "interface_declaration"}),
            frozenset({"statement_block", "class_body", "interface_body"}),
        ),
        Grammar(
            "typescriptreact",
            "tree_sitter_typescript",
            "language_tsx",
            frozenset({"import_statement"}),
            frozenset({"function_declaration", "class_declaration", "method_definition", "interface_declaration"}),
            frozenset({"statement_block", "class_body", "interface_body"}),
        ),
        Grammar(
            "go",
            "tree_sitter_go",
            "language",
            frozenset({"package_clause", "import_declaration"}),
            frozenset({"function_declaration", "method_declaration", "type_declaration"}),
            frozenset({"block", "field_declaration_list"}),
        ),
        Grammar(
            "rust",
            "tree_sitter_rust",
            "language",
            frozenset({"use_declaration", "extern_crate_declaration"}),
            frozenset({"function_item", "impl_item", "trait_item", "mod_item", "struct_item", "enum_item"}),
            frozenset({"block", "declaration_list", "field_declaration_list"}),
        ),
        Grammar(
            "c",
            "tree_sitter_c",
            "language",
            frozenset({"preproc_include"}),
            frozenset({"function_definition", "struct_specifier"}),
            _C_LIKE_BLOCKS,
        ),
        Grammar(
            "cpp",
            "tree_sitter_cpp",
            "language",
            frozenset({"preproc_include", "using_declaration"}),
            frozenset({"function_definition", "class_specifier", "struct_specifier", "namespace_definition"}),
            _C_LIKE_BLOCKS,
        ),
        Grammar(
            "java",
            "tree_sitter_java",
            "language",
            frozenset({"package_declaration", "import_declaration"}),
            frozenset({"class_declaration", "interface_declaration", "method_declaration", "constructor_declaration"}),
            frozenset({"block", "class_body", "interface_body", "constructor_body"}),
        ),
        Grammar(
            "lua",
            "tree_sitter_lua",
            "language",
            frozenset(),
            frozenset({"function_declaration", "function_definition"}),
            frozenset({"block"}),
        ),
    )
}
ALIASES = {"javascriptreact": "javascript", "jsx": "javascript", "tsx": "typescriptreact", "c++": "cpp"}
EXTENSIONS = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".jsx": "javascript", ".ts": "typescript", ".mts": "typescript", ".tsx": "typescriptreact", ".go": "go",
    ".rs": "rust", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp", ".hpp": "cpp", ".hh": "cpp",
    ".java": "java", ".lua": "lua",
}  # fmt: skip


def language_for(language_id: str | None, uri: str = "") -> str:
    """The canonical language name for an LSP languageId, falling back on the file extension, else 'plaintext'."""
    name = ALIASES.get(language_id or "", language_id or "")
    if name in GRAMMARS:
        return name
    return EXTENSIONS.get(PurePosixPath(uri).suffix.lower(), name or "plaintext")


@cache
def _language(name: str) -> Language:
    grammar = GRAMMARS[name]
    return Language(getattr(importlib.import_module(grammar.module), grammar.function)())


def parser_for(name: str) -> Parser | None:
    """A fresh parser for the language, or None when it has no grammar (plain-text fallback)."""
    if name not in GRAMMARS:
        return None
    return Parser(_language(name))
