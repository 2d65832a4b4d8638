"""TLS to Redis: one definition of the options every client uses, roles and SDK alike.

A ``rediss://`` server with a private CA needs three files on each client (the CA bundle,
and a client certificate and key when the server asks for them); ``RedisTls`` holds them
and turns them into redis-py's keyword arguments. The roles fill it from their settings
(``ROLLQ_REDIS_CA_FILE``, ``ROLLQ_REDIS_CERT_FILE``, ``ROLLQ_REDIS_KEY_FILE``,
``ROLLQ_REDIS_TLS_VERIFY``, or the config file), the trainer SDK from its settings and
the same variables (``from_environ``).

redis-py also reads ``ssl_*`` options from a URL's query (``rediss://host/0?ssl_ca_certs=
/ca.pem``); arq's URL parser drops them, so ``url_tls_options`` gives them to the arq
connections too, and every client honours them alike (the URL's win over the settings', as
in redis-py). A query option redis-py does not know is refused with the ones it does.

A certificate that does not verify is a setting to fix, not an outage
(``schemas.errors.tls_failure``): the roles exit 78 naming the files to check.

It lives in the leaf package because producers (arq's connection), consumers (the SDK)
and ops (the roles) all use it and may not import each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rollq.schemas.errors import ConfigError

TLS_SCHEMES = ("rediss", "rediss+cluster")
URL_TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
                   "ssl_check_hostname")
"""The ``ssl_*`` query options of a Redis URL that rollq honours on every connection."""
ENVIRONMENT = {"ca_file": "ROLLQ_REDIS_CA_FILE", "cert_file": "ROLLQ_REDIS_CERT_FILE",
               "key_file": "ROLLQ_REDIS_KEY_FILE", "verify": "ROLLQ_REDIS_TLS_VERIFY"}
"""The variables a role reads for each field (its settings' ``redis_<field>``)."""
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class RedisTls:
    """The TLS files and verification of a client; used only for ``rediss://`` URLs.

    - ``ca_file``: the CA bundle that signed the server's certificate (None: the system's).
    - ``cert_file``/``key_file``: a client certificate and its key, for servers that
      require one (``tls-auth-clients yes``).
    - ``verify``: verify the server's certificate (turn off only for tests).
    """

    ca_file: Path | str | None = None
    cert_file: Path | str | None = None
    key_file: Path | str | None = None
    verify: bool = True

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, ca_file: Path | str | None = None,
                     cert_file: Path | str | None = None, key_file: Path | str | None = None,
                     verify: bool | None = None) -> RedisTls:
        """The given fields, else the ``ROLLQ_REDIS_*`` variables of ``environ``."""
        raw_verify = environ.get(ENVIRONMENT["verify"])
        return cls(
            ca_file=ca_file or environ.get(ENVIRONMENT["ca_file"]) or None,
            cert_file=cert_file or environ.get(ENVIRONMENT["cert_file"]) or None,
            key_file=key_file or environ.get(ENVIRONMENT["key_file"]) or None,
            verify=verify if verify is not None else (
                raw_verify is None or raw_verify.strip().lower() not in _FALSE))

    def options(self, url: str) -> dict[str, Any]:
        """redis-py keyword arguments for ``url``: empty unless it is a TLS URL."""
        url_tls_options(url)  # redis-py reads them itself: only check them here
        if urlsplit(url).scheme not in TLS_SCHEMES:
            return {}
        options: dict[str, Any] = {"ssl_cert_reqs": "required" if self.verify else "none"}
        for name, value in (("ssl_ca_certs", self.ca_file), ("ssl_certfile", self.cert_file),
                            ("ssl_keyfile", self.key_file)):
            if value is not None:
                options[name] = str(value)
        return options


def url_tls_options(url: str) -> dict[str, Any]:
    """The ``ssl_*`` options in ``url``'s query, as redis-py reads them; ``ConfigError``
    for one it does not know, or for any on a URL that is not ``rediss://``."""
    parts = urlsplit(url)
    found = {name: value for name, value in parse_qsl(parts.query) if name.startswith("ssl")}
    unknown = sorted(set(found) - set(URL_TLS_OPTIONS))
    if unknown:
        raise ConfigError(f"Redis URL option {unknown[0]!r} is not one rollq honours: use "
                          f"{', '.join(URL_TLS_OPTIONS)} (or the redis_ca_file, "
                          "redis_cert_file, redis_key_file settings)")
    if found and parts.scheme not in TLS_SCHEMES:
        raise ConfigError(f"Redis URL option {next(iter(found))!r} needs a rediss:// URL "
                          f"(TLS), not {parts.scheme}://")
    options: dict[str, Any] = dict(found)
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() not in _FALSE
    return options
