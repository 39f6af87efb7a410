"""What ql3 prints of text it did not write itself: connection secrets redacted, control
characters escaped. One place for both, so that every error line, log line and table a
command prints gets the same treatment.

- **Secrets.** A DSN or Redis URL reaches an error message in many ways: argparse echoes a
  misplaced ``--dsn`` value, libpq quotes the piece of a conninfo it could not use, a
  caller's exception carries the URL it was given. :func:`redact` hides the password of
  every URL (``postgresql://u:***@h/db``, ``redis://:***@h``), every ``password=`` field
  of a key=value conninfo or a query string (``sslpassword`` and ``ssl_password`` too),
  and, literally, each secret the caller knows of (:func:`connection_secrets`).
- **Control characters.** An identifier is 1..128 characters of any text, so a project_id
  or a model name may hold ESC (U+001B) or CSI (U+009B), which a terminal would obey:
  recolour, move the cursor, rewrite the title, hide what follows. :func:`escape_controls`
  writes C0, DEL and C1 as ``\\xNN`` and the line and paragraph separators (U+2028,
  U+2029) as ``\\uNNNN``; :func:`json_text` escapes what ``json.dumps`` leaves raw with
  ``ensure_ascii=False`` (DEL, C1 with U+0085 among them, U+2028, U+2029) as JSON's own
  ``\\u00NN``, so the document still decodes to the same values while other scripts stay
  readable. Bidirectional marks are left as they are: they are text, in RTL names.

Standard library only: the SQLite edge shim logs through ``ql3.logs``, which uses this.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlsplit

if TYPE_CHECKING:
    import argparse

REDACTED = "***"

# A secret shorter than this is not replaced literally: it would hide ordinary words of
# the message ("db", "ql3"). The patterns still hide it where it stands in a DSN or URL.
MIN_LITERAL_SECRET = 4

# scheme://user:password@ : the password runs to the last "@" of the word, as a password
# holding an unencoded "@" ends there for the reader too.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^:/?#@\s'\"]*):(?P<password>\S*)@"
)
# The end of an unquoted value: a space or the end, or the quote that closes the text
# around it (argparse's 'value', a repr) before a space or punctuation. A quote elsewhere
# is the value's own.
_VALUE_END = r"(?=\s|$|['\"](?:[\s,.:;)\]}]|$))"
# ?password=... or &ssl_password=... in a URL's query string: the value ends at "&".
_QUERY_PASSWORD = re.compile(
    rf"(?P<head>[?&][^=&\s]*password=)(?P<value>[^&#\s]*?(?=[&#]|{_VALUE_END}))", re.I
)
# password=... in a key=value conninfo: a quoted value (backslash escapes), or an
# unquoted one up to the next space.
_FIELD_PASSWORD = re.compile(
    r"(?P<head>(?<![?&])\b\w*password\s*=\s*)"
    rf"(?P<value>'(?:[^'\\]|\\.)*'?|(?:\\.|[^\s\\])*?{_VALUE_END})",
    re.I,
)
# One field of a key=value conninfo, for connection_secrets.
_FIELD = re.compile(r"(\w+)\s*=\s*('(?:[^'\\]|\\.)*'|(?:\\.|[^\s\\])*)")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every password of a URL or conninfo in it, and each of ``secrets``
    (at least ``MIN_LITERAL_SECRET`` characters), replaced by ``***``."""
    if not secrets and "://" not in text and "password" not in text.lower():
        return text  # every pattern below needs one of the two: no regex on a plain log field
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}:{REDACTED}@", text)
    text = _QUERY_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}", text)
    text = _FIELD_PASSWORD.sub(lambda m: f"{m['head']}{REDACTED}", text)
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= MIN_LITERAL_SECRET:
            text = text.replace(secret, REDACTED)
    return text


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs: the one in the userinfo and those in
    the query string (``?password=...``, ``?ssl_password=...``, which redis-py accepts).
    The rest stays as written (``[IPv6]`` brackets, ``unix:///path``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    redacted = url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    if ":" in userinfo:
        user = userinfo.partition(":")[0]
        redacted = redacted.replace(f"//{parts.netloc}", f"//{user}:***@{hostport}", 1)
    if parts.query:
        fields = []
        for field in parts.query.split("&"):
            name, eq, _ = field.partition("=")
            if eq and unquote(name).lower().endswith("password"):
                field = f"{name}=***"
            fields.append(field)
        redacted = redacted.replace(f"?{parts.query}", "?" + "&".join(fields), 1)
    return redacted


def connection_secrets(*conninfos: str | None) -> frozenset[str]:
    """The passwords in DSNs and URLs (None and "" skipped), as written and decoded, so
    that :func:`redact` finds them in any message that quotes them."""
    found: set[str] = set()
    for conninfo in conninfos:
        if conninfo:
            found.update(_url_secrets(conninfo) if "://" in conninfo else _field_secrets(conninfo))
    found.discard("")
    return frozenset(found)


def _url_secrets(url: str) -> set[str]:
    try:
        parts = urlsplit(url)
    except ValueError:
        return {url}  # unparsable: the whole of it may be a secret
    userinfo = parts.netloc.rpartition("@")[0]
    found = set()
    if ":" in userinfo:
        raw = userinfo.partition(":")[2]
        # libpq ends the userinfo at the first "@", so a message may quote what follows
        # an unencoded "@" of the password as part of the host.
        found |= {raw, unquote(raw), *raw.split("@")}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower().endswith("password"):
            found.add(value)
    return found


def _field_secrets(conninfo: str) -> set[str]:
    found = set()
    for name, value in _FIELD.findall(conninfo):
        if name.lower().endswith("password"):
            inner = value[1:-1] if value.startswith("'") else value
            found |= {value, inner, re.sub(r"\\(.)", r"\1", inner)}
    return found


# C0 (tab and newline included: one line stays one line), DEL and C1 as \xNN; the Unicode
# line and paragraph separators as \uNNNN.
_TEXT_ESCAPES = {
    **{code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))},
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}
# What json.dumps(ensure_ascii=False) leaves raw (it escapes C0 itself), as JSON escapes.
_JSON_ESCAPES = {code: f"\\u{code:04x}" for code in (*range(0x7F, 0xA0), 0x2028, 0x2029)}


def escape_controls(text: str) -> str:
    """``text`` with every control character written out (``\\x1b``, ``\\x9b``,
    ``\\u2028``): safe to print on a terminal, on one line."""
    return text.translate(_TEXT_ESCAPES)


def json_text(value: Any, **options: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, **options)`` with DEL, C1 and U+2028/U+2029
    escaped: the same JSON, safe to print on a terminal."""
    return json.dumps(value, ensure_ascii=False, **options).translate(_JSON_ESCAPES)


def error_text(text: str, secrets: Iterable[str] = ()) -> str:
    """One line of an error message for a terminal or a log: whitespace runs (libpq's
    messages span lines) made one space, secrets redacted, control characters escaped."""
    return escape_controls(redact(" ".join(text.split()), secrets))


# The settings of ql3's commands that hold a DSN or a Redis URL, and their variables.
SECRET_SETTINGS = ("dsn", "listen_dsn", "redis_url")
SECRET_VARIABLES = ("QL3_DSN", "QL3_RELAY_LISTEN_DSN", "QL3_REDIS_URL")


def command_secrets(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> frozenset[str]:
    """The passwords of the DSNs and URLs a command was given, by flag or variable: what
    its error lines must not show, however a message came to quote them."""
    env = os.environ if environ is None else environ
    given = [getattr(args, name, None) for name in SECRET_SETTINGS]
    return connection_secrets(*given, *(env.get(name) for name in SECRET_VARIABLES))
