"""Images in chat requests: fetched, decoded and checked before the prompt is rendered.

An ``image_url`` content part names its image by a ``data:`` URL (base64 PNG, JPEG, WebP or
GIF, whose first frame is taken) or by an ``http(s)://`` URL, which the server fetches only
from the hosts ``--allowed-media-domains`` names (none by default)::

    data:image/png;base64,...  ── media type, size of the base64 text ─────────────────────────┐
    https://host/cat.png ── scheme, host allowed? ── resolve, every address public? ── GET the  │
        checked address (Host header and TLS name the host) ── a redirect: the same checks again │
        ── status, content type, body read up to the size limit ─────────────────────────────────┤
                                                                                                 v
    open:   PNG/JPEG/WebP/GIF only, pixels counted from the header, per image and for all the
            request's images together, before any is decoded
    decode: RGB (transparency over white), content hash of the pixels ── DecodedImage

Every refusal is a 400 naming the part (``messages.{i}.content.{j}.image_url``) and what was
wrong with it. The whole fetch of one image, redirects and all, has one deadline
(``fetch_timeout_s``).

Server-side request forgery. Even a host that is allowed must not lead the server to its own
network: its name is resolved here, and the fetch is refused unless every address it resolves
to is public (not loopback, private, link-local, multicast, reserved, unspecified or shared
space, IPv4 or IPv6, nor an IPv6 form carrying such an IPv4 address: mapped, NAT64, 6to4,
Teredo), unless ``allow_private`` is set. The request then goes to the checked address itself:
the URL's host is replaced by the IP, the ``Host`` header keeps the name, and over HTTPS
httpcore's ``sni_hostname`` extension keeps the name for SNI and for the certificate check. So
no second DNS lookup happens between the check and the connection, and a name that resolves
to a public address for the check and to 127.0.0.1 a moment later (DNS rebinding) cannot reach
127.0.0.1. Environment proxies are not used (``trust_env=False``: a proxy would resolve the name
itself), redirects are followed by hand, each hop checked like the first, and each hop gets a
client of its own, so a connection is never reused for a host it was not opened for.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import ipaddress
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from PIL import Image

from engine.loading.multimodal import image_content_hash as content_hash
from engine.loading.multimodal import to_rgb, upright
from server import __version__
from server.errors import bad_request

# Decoded format (PIL's name) -> its media type; only these decoders are ever run on client bytes.
IMAGE_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/pjpeg", "image/webp", "image/gif"}
_FORMATS_TEXT = "PNG, JPEG, WebP or GIF"
DETAILS = ("auto", "low", "high")  # OpenAI's image_url.detail
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # IPv6 addresses a NAT64 gateway turns into the IPv4 in their last bits


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images may be, and where the server may fetch them from.

    ``allowed_domains``: hosts image URLs may name; a domain also allows its subdomains, ``*``
    any host, and an empty tuple (the default) turns remote fetching off (``data:`` URLs always
    work). ``allow_private``: fetch from loopback and private addresses too (for a server whose
    images live on its own network; never on a server that strangers reach)."""

    max_image_bytes: int = 20 * 2**20  # encoded: the data: URL's decoded bytes, or the fetched body
    max_image_pixels: int = 50_000_000  # width x height, checked from the header before decoding
    max_request_pixels: int = 100_000_000  # all images of a request together, checked before any is decoded
    fetch_timeout_s: float = 10.0  # one image's whole fetch: DNS, connections, redirects and body
    max_images_per_request: int = 16
    allowed_domains: tuple[str, ...] = ()
    allow_private: bool = False
    max_redirects: int = 5

    def __post_init__(self) -> None:
        if (self.max_image_bytes < 1 or self.max_image_pixels < 1 or self.max_request_pixels < 1
                or self.max_images_per_request < 0):
            raise ValueError("the image size, pixel and count limits must be positive")
        if not self.fetch_timeout_s > 0 or self.max_redirects < 0:
            raise ValueError("the media fetch timeout must be positive and the redirect limit at least 0")
        object.__setattr__(self, "allowed_domains", tuple(_domain_entry(d) for d in self.allowed_domains))

    @property
    def remote_fetching(self) -> bool:
        return bool(self.allowed_domains)

    def domain_allowed(self, host: str) -> bool:
        """Whether ``host`` (as a URL names it) is one of the allowed domains or a subdomain of one."""
        host = _host_key(host)
        for entry in self.allowed_domains:
            if entry == "*" or host == entry or (not _is_ip(entry) and host.endswith("." + entry)):
                return True
        return False


@dataclass(frozen=True)
class ImageRef:
    """An image a request names, not yet fetched: its URL, OpenAI's ``detail``, and the request field it came in."""

    url: str
    detail: str = "auto"
    param: str = "image_url"


@dataclass(frozen=True, eq=False)
class DecodedImage:
    """One decoded image of a request, for the model's image processor (which makes the engine's
    ``engine.loading.multimodal.ImageInput`` of it)."""

    image: Image.Image  # RGB, fully loaded
    content_hash: str  # engine.multimodal.image_content_hash: equal pixels, equal hash, however sent
    detail: str = "auto"  # OpenAI's detail, passed along: "auto", "low" or "high"
    format: str = ""  # the format it was decoded from: PNG, JPEG, WEBP or GIF

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


async def fetch_images(refs: Sequence[ImageRef], limits: MediaLimits) -> list[DecodedImage]:
    """The images, fetched and decoded concurrently, in the order given; the first failure is the
    request's error (the other fetches are cancelled). Every image's header is read first: the request's
    pixels together are checked (``max_request_pixels``) before any image is decoded."""
    if len(refs) > limits.max_images_per_request:
        raise bad_request(f"this request has {len(refs)} images; the server accepts at most "
                          f"{limits.max_images_per_request} per request (--max-images-per-request)", param="messages")
    opened = await _gather([_fetch_opened(ref.url, limits, ref.param, ref.detail) for ref in refs])
    total = sum(image.width * image.height for image in opened)
    if total > limits.max_request_pixels:
        raise bad_request(f"the images of this request have {total:,} pixels together; the server accepts at most "
                          f"{limits.max_request_pixels:,} per request (--max-request-megapixels)", param="messages")
    return await _gather([asyncio.to_thread(finish_decoding, image, ref.param, ref.detail)
                          for image, ref in zip(opened, refs)])


async def _gather(coroutines: list) -> list:
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def fetch_image(url: str, limits: MediaLimits, *, param: str = "image_url",
                      detail: str = "auto") -> DecodedImage:
    """One image by its URL (``data:`` or ``http(s)://``), decoded; a 400 naming ``param`` if it cannot be had.
    Decoding runs in a worker thread, so a large image does not stall the event loop."""
    image = await _fetch_opened(url, limits, param, detail)
    return await asyncio.to_thread(finish_decoding, image, param, detail)


async def _fetch_opened(url: str, limits: MediaLimits, param: str, detail: str) -> Image.Image:
    """An image's bytes, fetched, and its header read (its size checked): nothing decoded yet."""
    if detail not in DETAILS:
        raise bad_request(f"{param}.detail must be one of {', '.join(DETAILS)}, got {detail!r}", param=param)
    scheme = url.partition(":")[0].strip().lower() if ":" in url else ""
    if scheme == "data":
        return await asyncio.to_thread(lambda: open_image(data_url_bytes(url, limits, param=param), limits,
                                                          param=param))
    if scheme not in ("http", "https"):
        shown = f"{scheme}:" if scheme else "a URL without a scheme"
        raise bad_request(f"{param}: images come as data: URLs or http(s):// URLs, not {shown}", param=param)
    data = await fetch_bytes(url, limits, param=param)
    return await asyncio.to_thread(open_image, data, limits, param=param)


# ------------------------------------------------------------------------ data: URLs


def load_data_url(url: str, limits: MediaLimits, *, param: str = "image_url",
                  detail: str = "auto") -> DecodedImage:
    """A ``data:image/...;base64,...`` URL, decoded."""
    return decode_image(data_url_bytes(url, limits, param=param), limits, param=param, detail=detail)


def data_url_bytes(url: str, limits: MediaLimits, *, param: str = "image_url") -> bytes:
    """The bytes a ``data:image/...;base64,...`` URL carries. The size is checked on the base64 text before it
    is decoded, so an oversized URL costs no decoding."""
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise bad_request(f"{param}: a data: URL needs a comma between its media type and its data", param=param)
    fields = [f.strip().lower() for f in header.split(";")]
    media_type = fields[0] or "text/plain"  # RFC 2397's default
    if media_type not in _MEDIA_TYPES:
        raise bad_request(f"{param}: unsupported image type {media_type!r}; send {_FORMATS_TEXT}", param=param)
    if "base64" not in fields[1:]:
        raise bad_request(f"{param}: an image data: URL must be base64 (data:{media_type};base64,...)", param=param)
    if (len(payload) // 4) * 3 > limits.max_image_bytes + 3:
        raise _too_large(param, f"about {len(payload) // 4 * 3} bytes", limits)
    if any(c in payload for c in " \n\r\t"):
        payload = "".join(payload.split())  # line-wrapped base64
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data: URL's data is not valid base64", param=param) from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(param, f"{len(data)} bytes", limits)
    return data


# ----------------------------------------------------------------------------- decoding


def decode_image(data: bytes, limits: MediaLimits, *, param: str = "image_url",
                 detail: str = "auto") -> DecodedImage:
    """Encoded bytes to an RGB image and its hash (``open_image``, then ``finish_decoding``)."""
    return finish_decoding(open_image(data, limits, param=param), param, detail)


def open_image(data: bytes, limits: MediaLimits, *, param: str = "image_url") -> Image.Image:
    """Encoded bytes opened, not decoded: only PNG, JPEG, WebP and GIF are recognised, and the pixel count is
    read from the header and checked before any pixel is decoded (a small file may declare a huge image)."""
    if len(data) > limits.max_image_bytes:
        raise _too_large(param, f"{len(data)} bytes", limits)
    try:
        image = Image.open(io.BytesIO(data), formats=list(IMAGE_FORMATS))
    except Image.DecompressionBombError:  # PIL's own guard, at twice its MAX_IMAGE_PIXELS
        raise bad_request(f"{param}: the image has too many pixels (its header declares more than can be decoded "
                          f"safely: a decompression bomb)", param=param) from None
    except Image.UnidentifiedImageError:
        raise bad_request(f"{param}: the data is not a {_FORMATS_TEXT} image (or it is corrupt)", param=param) from None
    except Exception as exc:  # noqa: BLE001 - a decoder may raise anything on hostile bytes
        raise _corrupt(param, exc) from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels(param, f"{width}x{height} = {width * height:,} pixels; more than", limits)
    if width < 1 or height < 1:
        raise bad_request(f"{param}: the image is empty ({width}x{height})", param=param)
    return image


def finish_decoding(image: Image.Image, param: str = "image_url", detail: str = "auto") -> DecodedImage:
    """An opened image's pixels: the first frame of a GIF or an animated WebP, transparency laid over white,
    an EXIF orientation tag applied (``engine.loading.multimodal.upright``), RGB, with its content hash."""
    image_format = image.format or ""
    try:
        image.load()
        rgb = to_rgb(upright(image))
    except Exception as exc:  # noqa: BLE001 - truncated data, a bad checksum, a broken stream...
        raise _corrupt(param, exc) from None
    return DecodedImage(rgb, content_hash(rgb), detail, image_format)


def _corrupt(param: str, exc: Exception) -> Exception:
    reason = str(exc) or type(exc).__name__
    return bad_request(f"{param}: the image is corrupt or truncated and could not be decoded ({reason})", param=param)


def _too_large(param: str, size: str, limits: MediaLimits) -> Exception:
    return bad_request(f"{param}: the image is too large ({size}); the server accepts at most "
                       f"{limits.max_image_bytes} bytes per image (--max-image-mb)", param=param)


def _too_many_pixels(param: str, what: str, limits: MediaLimits) -> Exception:
    return bad_request(f"{param}: the image has too many pixels ({what} the {limits.max_image_pixels:,} the server "
                       f"accepts, --max-image-megapixels)", param=param)


# --------------------------------------------------------------------- remote fetching


async def fetch_bytes(url: str, limits: MediaLimits, *, param: str = "image_url") -> bytes:
    """An image URL's body, under the remote-fetching rules (module docstring); at most
    ``max_image_bytes``, counted while it arrives; within ``fetch_timeout_s`` in all."""
    if not limits.remote_fetching:
        raise bad_request(f"{param}: this server does not fetch images from URLs (it was started without "
                          f"--allowed-media-domains); send the image as a data: URL", param=param)
    try:
        return await asyncio.wait_for(_follow(url, limits, param), limits.fetch_timeout_s)
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise bad_request(f"{param}: fetching the image timed out after {limits.fetch_timeout_s:g} s "
                          f"(--media-fetch-timeout)", param=param) from None


async def _follow(url: str, limits: MediaLimits, param: str) -> bytes:
    current = url
    for hop in range(limits.max_redirects + 1):
        target = _checked_url(current, limits, param, redirected=hop > 0)
        addresses = await _checked_addresses(target, limits, param)
        body, location = await _get(target, addresses, limits, param)
        if location is None:
            return body
        try:
            current = str(target.join(location))
        except httpx.InvalidURL:
            raise bad_request(f"{param}: {_shown(target)} redirected to an invalid URL", param=param) from None
    raise bad_request(f"{param}: more than {limits.max_redirects} redirects fetching {_shown(httpx.URL(url))}",
                      param=param)


def _checked_url(url: str, limits: MediaLimits, param: str, redirected: bool) -> httpx.URL:
    """The URL parsed, if its scheme and host may be fetched."""
    where = "redirected to" if redirected else "the image URL is"
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError):
        raise bad_request(f"{param}: {where} an invalid URL", param=param) from None
    if parsed.scheme not in ("http", "https"):
        raise bad_request(f"{param}: {where} a {parsed.scheme or 'scheme-less'}: URL; only http(s) is fetched",
                          param=param)
    if not parsed.host:
        raise bad_request(f"{param}: {where} a URL without a host", param=param)
    if not limits.domain_allowed(parsed.host):
        raise bad_request(f"{param}: {where} on {parsed.host!r}, a domain this server does not fetch from "
                          f"(--allowed-media-domains)", param=param)
    return parsed


async def _getaddrinfo(host: str, port: int) -> list[str]:
    """The host's addresses, in the resolver's order (a seam for tests)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


async def _checked_addresses(url: httpx.URL, limits: MediaLimits, param: str) -> list[str]:
    """Where the host may be reached: its addresses, every one of them allowed (else a 400)."""
    host = url.raw_host.decode("ascii")
    if _is_ip(host):
        found = [host]
    else:
        try:
            found = await _getaddrinfo(host, url.port or (443 if url.scheme == "https" else 80))
        except (socket.gaierror, UnicodeError) as exc:
            raise bad_request(f"{param}: the image host {url.host!r} could not be resolved "
                              f"({getattr(exc, 'strerror', None) or exc})", param=param) from None
    addresses = list(dict.fromkeys(ipaddress.ip_address(a.split("%", 1)[0]) for a in found))
    if not addresses:
        raise bad_request(f"{param}: the image host {url.host!r} has no address", param=param)
    if not limits.allow_private:
        for address in addresses:
            reason = non_public_reason(address)
            if reason is not None:
                raise bad_request(f"{param}: the image host {url.host!r} resolves to {address}, a {reason} address; "
                                  f"this server fetches only from public addresses (private address refused, see "
                                  f"--allow-private-media-addresses)", param=param)
    return [str(a) for a in addresses]


def non_public_reason(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is not on the public internet ("loopback", "private", ...), or None when it is.
    IPv6 forms that carry an IPv4 address (mapped, NAT64, 6to4, Teredo) are judged by that address too."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address.teredo is not None:
            embedded = address.teredo[1]
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            reason = non_public_reason(embedded)
            if reason is not None:
                return reason
        if address.is_site_local:
            return "site-local"
    for reason in ("loopback", "unspecified", "link_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{reason}"):
            return reason.replace("_", "-")
    if not address.is_global:
        return "non-global"  # shared address space (100.64.0.0/10) and the like
    return None


async def _get(url: httpx.URL, addresses: list[str], limits: MediaLimits, param: str) -> tuple[bytes, str | None]:
    """One GET to the first of the checked addresses that accepts a connection: the body, or the
    ``Location`` of a redirect."""
    headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*", "User-Agent": f"minivllm/{__version__}"}
    extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
    async with httpx.AsyncClient(trust_env=False, follow_redirects=False, timeout=limits.fetch_timeout_s,
                                 verify=_ssl_context()) as client:
        failure: Exception | None = None
        for address in addresses:
            request = client.build_request("GET", url.copy_with(host=address), headers=headers, extensions=extensions)
            try:
                response = await client.send(request, stream=True)
            except httpx.ConnectError as exc:
                failure = exc
                continue
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as exc:
                raise bad_request(f"{param}: fetching {_shown(url)} failed: {exc or type(exc).__name__}",
                                  param=param) from None
            try:
                return await _read(response, url, limits, param)
            finally:
                await response.aclose()
        raise bad_request(f"{param}: could not connect to {_shown(url)} ({failure or 'no address'})", param=param)


async def _read(response: httpx.Response, url: httpx.URL, limits: MediaLimits, param: str) -> tuple[bytes, str | None]:
    status = response.status_code
    if status in _REDIRECTS and "location" in response.headers:
        return b"", response.headers["location"]
    if status != 200:
        raise bad_request(f"{param}: fetching {_shown(url)} failed with HTTP status {status}", param=param)
    content_type = response.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type and content_type != "application/octet-stream" and content_type not in _MEDIA_TYPES:
        kind = "an unsupported image type" if content_type.startswith("image/") else "not an image"
        raise bad_request(f"{param}: {_shown(url)} is {kind} (content type {content_type!r}); send {_FORMATS_TEXT}",
                          param=param)
    declared = response.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limits.max_image_bytes:
        raise _too_large(param, f"{declared} bytes, says its Content-Length", limits)
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():  # decompressed: a gzip bomb counts at its real size
            body += chunk
            if len(body) > limits.max_image_bytes:
                raise _too_large(param, f"more than {limits.max_image_bytes} bytes arrived", limits)
    except httpx.TimeoutException:
        raise
    except httpx.HTTPError as exc:
        raise bad_request(f"{param}: reading {_shown(url)} failed: {exc or type(exc).__name__}", param=param) from None
    return bytes(body), None


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default verifying context (certifi's CAs), built once: loading the CAs takes tens of ms."""
    return httpx.create_ssl_context()


def _shown(url: httpx.URL) -> str:
    """A URL for an error message: scheme, host and path, without credentials or query."""
    return f"{url.scheme}://{url.netloc.decode('ascii', 'replace')}{url.path}"


# ------------------------------------------------------------------------------ hosts


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _host_key(host: str) -> str:
    """A host as domains are compared: an IP in its canonical form, a name in lower case, ASCII (IDNA)."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if _is_ip(host):
        return str(ipaddress.ip_address(host))
    if not host.isascii():
        host = httpx.URL(f"http://{host}/").raw_host.decode("ascii")
    return host


def _domain_entry(entry: str) -> str:
    """An --allowed-media-domains entry as compared: ``*``, an IP, or a domain (``*.`` and ``.`` prefixes
    mean the same as the bare domain, which allows its subdomains anyway)."""
    text = entry.strip()
    if text == "*":
        return text
    text = text.removeprefix("*.").removeprefix(".")
    if not text or any(c in text for c in "/@?#\\ \t") or (":" in text and not _is_ip(text.strip("[]"))):
        raise ValueError(f"{entry!r} is not a host or a domain (give names like 'example.com', without scheme, "
                         f"port or path)")
    try:
        return _host_key(text)
    except httpx.InvalidURL:
        raise ValueError(f"{entry!r} is not a valid host name") from None
