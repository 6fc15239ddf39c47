"""Images in chat requests (server/media.py): data: URLs decoded to the same pixels and hash however they
were sent; corrupt, oversized, unsupported and bomb images refused; remote fetching off by default, allowed
hosts only, private addresses refused, redirects checked at every hop, slow and endless bodies cut off.
Then the chat side (parts found and refused before any fetch, the template's multimodal parts) and one real
server whose text-only model refuses images without fetching them."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import ipaddress
import shutil
import ssl
import struct
import subprocess
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import httpx
import openai
import pytest
from PIL import Image

from server import media
from server.cli import build_parser, check_media_args, media_limits_from_args
from server.errors import APIError
from server.media import ImageRef, MediaLimits, content_hash, fetch_image, fetch_images, non_public_reason
from server.protocol import ChatMessageParam
from server.tokenization import ChatTemplateOptions, chat_image_parts, render_chat

pytest.register_assert_rewrite("tests.server_helpers")
from tests.server_helpers import TINY_MODEL_NAME, start_server, tiny_server_args  # noqa: E402

pytest_plugins = ["tests.server_helpers"]

PARAM = "messages.0.content.1.image_url"


def picture(seed: int = 0, size: tuple[int, int] = (48, 32), mode: str = "RGB") -> Image.Image:
    """A deterministic picture with many colours (a gradient, shifted by ``seed``)."""
    width, height = size
    image = Image.new("RGB", size)
    image.putdata([((x * 5 + seed) % 256, (y * 7 + 3 * seed) % 256, (x * y + seed) % 256)
                   for y in range(height) for x in range(width)])
    return image.convert(mode)


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def load(url: str, limits: MediaLimits = MediaLimits(), detail: str = "auto") -> media.DecodedImage:
    return asyncio.run(fetch_image(url, limits, param=PARAM, detail=detail))


def refused(url: str, limits: MediaLimits = MediaLimits()) -> APIError:
    with pytest.raises(APIError) as info:
        load(url, limits)
    assert info.value.status_code == 400 and info.value.param == PARAM, info.value.message
    return info.value


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height`` pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


# ------------------------------------------------------------------------ decoding


def test_png_webp_and_jpeg_data_urls_decode_to_the_source_pixels_and_hash():
    source = picture()
    for fmt, options in [("PNG", {}), ("WEBP", {"lossless": True})]:
        image = load(data_url(encoded(source, fmt, **options), f"image/{fmt.lower()}"), detail="high")
        assert (image.format, image.image.mode, image.size, image.detail) == (fmt, "RGB", source.size, "high")
        assert image.image.tobytes() == source.tobytes()
        assert image.content_hash == content_hash(source)
    # JPEG is lossy: the pixels are the JPEG's own (as PIL decodes it), close to the source, hashed as such.
    jpeg = encoded(source, "JPEG", quality=95, subsampling=0)
    image = load(data_url(jpeg, "image/jpeg"))
    decoded = Image.open(io.BytesIO(jpeg)).convert("RGB")
    assert image.image.tobytes() == decoded.tobytes() and image.content_hash == content_hash(decoded)
    differences = [abs(a - b) for a, b in zip(image.image.tobytes(), source.tobytes())]
    assert sum(differences) / len(differences) < 4
    assert load(data_url(jpeg, "image/jpeg")).content_hash == image.content_hash  # stable


def test_same_picture_same_hash_different_pictures_different_hashes():
    source = picture(seed=1, mode="RGBA")
    png, webp = encoded(source, "PNG"), encoded(source, "WEBP", lossless=True)
    assert png != webp
    assert load(data_url(png)).content_hash == load(data_url(webp, "image/webp")).content_hash
    other = picture(seed=1)
    other.putpixel((0, 0), (1, 2, 3))
    hashes = {content_hash(picture(seed=1)), content_hash(other), content_hash(picture(seed=2)),
              content_hash(picture(size=(32, 48)))}
    assert len(hashes) == 4
    # The same bytes in another shape are another picture.
    flat = picture(size=(4, 6))
    assert content_hash(flat) != content_hash(Image.frombytes("RGB", (6, 4), flat.tobytes()))


def test_transparency_is_laid_over_white_and_a_gif_gives_its_first_frame():
    clear = Image.new("RGBA", (8, 8), (200, 0, 0, 0))
    assert load(data_url(encoded(clear, "PNG"))).image.getpixel((3, 3)) == (255, 255, 255)
    frames = [Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=100)
    image = load(data_url(out.getvalue(), "image/gif"))
    assert image.format == "GIF" and image.image.getpixel((4, 4)) == (255, 0, 0)


def test_an_exif_orientation_is_applied_by_the_server_and_the_offline_engine():
    """A photo stored sideways with an EXIF orientation tag (6: turn 90 degrees clockwise to view) reaches the model
    upright, as a viewer shows it, through the server's decoder and the offline ``load_image`` alike; the hash is
    the upright pixels'."""
    from engine.loading.multimodal import image_content_hash, load_image

    stored = picture(size=(48, 32))
    exif = Image.Exif()
    exif[0x0112] = 6
    png = encoded(stored, "PNG", exif=exif)
    upright = stored.transpose(Image.Transpose.ROTATE_270)  # 90 degrees clockwise: 32 wide, 48 high
    image = load(data_url(png))
    assert image.size == (32, 48) and image.image.tobytes() == upright.tobytes()
    assert image.content_hash == content_hash(upright) == image_content_hash(upright)
    offline = load_image(png)
    assert offline.size == (32, 48) and offline.tobytes() == upright.tobytes()
    assert load(data_url(encoded(stored, "PNG"))).size == (48, 32)  # no tag: as stored


@pytest.mark.parametrize("url, says", [
    (data_url(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20), "corrupt"),
    (data_url(encoded(picture(), "PNG")[:300]), "corrupt"),  # truncated
    (data_url(b"definitely not an image"), "not a PNG, JPEG, WebP or GIF image"),
    (data_url(encoded(picture(), "BMP")), "not a PNG, JPEG, WebP or GIF image"),  # a decoder we never run
    ("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), "unsupported image type 'image/svg+xml'"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported image type 'text/plain'"),
    ("data:,hello", "unsupported image type 'text/plain'"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64,!!!not-base64!!!", "not valid base64"),
    ("data:image/png;base64", "needs a comma"),
    ("file:///etc/passwd", "not file:"),
    ("ftp://example.com/cat.png", "not ftp:"),
    ("cat.png", "without a scheme"),
], ids=["corrupt", "truncated", "not-an-image", "bmp", "svg", "text", "default-type", "not-base64-encoded",
        "bad-base64", "no-comma", "file", "ftp", "no-scheme"])
def test_bad_images_are_400s_saying_what_is_wrong(url, says):
    assert says in refused(url).message


def test_an_oversized_data_url_is_refused_before_decoding():
    url = "data:image/png;base64," + "A" * (50 * 2**20)  # 50 MB of base64
    started = time.perf_counter()
    error = refused(url)
    assert time.perf_counter() - started < 1.0
    assert "too large" in error.message and str(20 * 2**20) in error.message
    small = MediaLimits(max_image_bytes=100)
    assert "too large" in refused(data_url(encoded(picture(), "PNG")), small).message


@pytest.mark.parametrize("width, height", [(100_000, 100_000), (8_000, 8_000)], ids=["beyond-PIL", "beyond-ours"])
def test_decompression_bombs_are_refused_from_their_header(width, height):
    started = time.perf_counter()
    error = refused(data_url(png_declaring(width, height)))
    assert "too many pixels" in error.message
    assert time.perf_counter() - started < 1.0  # nothing was decoded
    few = MediaLimits(max_image_pixels=100)
    assert "11x10 = 110 pixels" in refused(data_url(encoded(picture(size=(11, 10)), "PNG")), few).message


# ------------------------------------------------------------------ hosts and addresses


def test_allowed_domains_match_hosts_and_their_subdomains():
    limits = MediaLimits(allowed_domains=("Example.COM.", "*.cdn.net", "10.0.0.7", "::1"))
    assert limits.allowed_domains == ("example.com", "cdn.net", "10.0.0.7", "::1")
    for host in ["example.com", "img.example.com", "a.b.EXAMPLE.com.", "cdn.net", "x.cdn.net", "10.0.0.7", "::1",
                 "0:0::1"]:
        assert limits.domain_allowed(host), host
    for host in ["badexample.com", "example.com.evil.org", "net", "10.0.0.70", "x.10.0.0.7", "::2"]:
        assert not limits.domain_allowed(host), host
    assert MediaLimits(allowed_domains=("*",)).domain_allowed("anything.org")
    assert not MediaLimits().remote_fetching and not MediaLimits().domain_allowed("example.com")
    for bad in ["http://example.com", "example.com/images", "user@example.com", "example.com:8080", ""]:
        with pytest.raises(ValueError):
            MediaLimits(allowed_domains=(bad,))


@pytest.mark.parametrize("address, reason", [
    ("127.0.0.1", "loopback"), ("10.1.2.3", "private"), ("192.168.0.1", "private"), ("172.16.5.4", "private"),
    ("169.254.169.254", "link-local"), ("224.0.0.1", "multicast"), ("0.0.0.0", "unspecified"),
    ("100.64.0.1", "non-global"), ("::1", "loopback"), ("::", "unspecified"), ("fe80::1", "link-local"),
    ("fc00::1", "private"), ("ff02::1", "multicast"), ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:10.0.0.1", "private"), ("64:ff9b::7f00:1", "loopback"), ("2002:7f00:1::", "loopback"),
    ("8.8.8.8", None), ("1.1.1.1", None), ("2606:4700:4700::1111", None),
])
def test_addresses_off_the_public_internet_are_named(address, reason):
    assert non_public_reason(ipaddress.ip_address(address)) == reason


def test_cli_flags_make_the_media_limits():
    parser = build_parser()
    assert media_limits_from_args(parser.parse_args(["serve"])) == MediaLimits()  # the same defaults
    args = parser.parse_args(["serve", "--allowed-media-domains", "a.com,B.org", "c.net", "--max-image-mb", "2",
                              "--allow-private-media-addresses", "--media-fetch-timeout", "3",
                              "--max-images-per-request", "4", "--max-image-megapixels", "1.5",
                              "--max-request-megapixels", "2.5"])
    assert media_limits_from_args(args) == MediaLimits(max_image_bytes=2 * 2**20, max_image_pixels=1_500_000,
                                                       max_request_pixels=2_500_000, fetch_timeout_s=3.0,
                                                       max_images_per_request=4,
                                                       allowed_domains=("a.com", "b.org", "c.net"), allow_private=True)
    for flags in (["--allowed-media-domains", "https://a.com/"], ["--max-image-mb", "0"],
                  ["--media-fetch-timeout", "-1"], ["--max-request-megapixels", "0"]):
        with pytest.raises(Exception, match="must be|not a host"):
            check_media_args(parser.parse_args(["serve", *flags]))


# ---------------------------------------------------------------------- remote fetching


class _ImageHandler(BaseHTTPRequestHandler):
    """The test images' host: /img.png, and misbehaving routes (slow, endless, redirecting, ...)."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        site = self.server.site
        url = urlparse(self.path)
        with site.lock:
            site.hits[url.path] += 1
            site.hosts.append(self.headers.get("Host"))
        try:
            self._answer(url.path, parse_qs(url.query), site)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _answer(self, path: str, query: dict, site) -> None:
        if path == "/img.png":
            self._send(200, site.png, "image/png")
        elif path == "/octets":
            self._send(200, site.png, "application/octet-stream")
        elif path == "/page.html":
            self._send(200, b"<html></html>", "text/html")
        elif path == "/drawing.svg":
            self._send(200, b"<svg/>", "image/svg+xml")
        elif path == "/missing.png":
            self._send(404, b"no", "text/plain")
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", query["to"][0])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/loop":
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path == "/slow-headers":
            time.sleep(3)
            self._send(200, site.png, "image/png")
        elif path == "/slow-body":  # a byte every 0.1 s: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(site.png)))
            self.end_headers()
            for i in range(len(site.png)):
                self.wfile.write(site.png[i:i + 1])
                self.wfile.flush()
                time.sleep(0.1)
        elif path == "/endless":  # no Content-Length: the body ends when the connection does (here: never)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(4096):
                self.wfile.write(b"\0" * 65536)
        elif path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(10**12))
            self.end_headers()
        else:
            self._send(404, b"", "text/plain")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serve_images(tls: ssl.SSLContext | None = None):
    """A local HTTP(S) server on 127.0.0.1 serving a picture (and misbehaving), counting its requests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    source = picture(seed=3)
    scheme = "https" if tls else "http"
    server.site = SimpleNamespace(lock=threading.Lock(), hits=Counter(), hosts=[], source=source,
                                  png=encoded(source, "PNG"), port=server.server_address[1],
                                  url=f"{scheme}://127.0.0.1:{server.server_address[1]}")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def image_site():
    server = serve_images()
    yield server.site
    server.shutdown()
    server.server_close()


@pytest.fixture
def site(image_site):
    with image_site.lock:
        image_site.hits.clear()
        image_site.hosts.clear()
    return image_site


LOOPBACK_ALLOWED = MediaLimits(allowed_domains=("127.0.0.1", "localhost"), allow_private=True)


def test_remote_fetching_is_off_by_default(site):
    assert "does not fetch images from URLs" in refused(f"{site.url}/img.png").message
    assert sum(site.hits.values()) == 0


def test_an_allowed_host_on_a_private_address_is_refused(site):
    for url in (f"{site.url}/img.png", f"http://localhost:{site.port}/img.png"):
        error = refused(url, MediaLimits(allowed_domains=("127.0.0.1", "localhost")))
        assert "loopback address" in error.message and "private address refused" in error.message
    assert "domain this server does not fetch from" in refused(f"{site.url}/img.png",
                                                               MediaLimits(allowed_domains=("example.com",))).message
    assert sum(site.hits.values()) == 0


def test_an_allowed_host_is_fetched_when_private_addresses_are_allowed(site):
    for url in (f"{site.url}/img.png", f"http://localhost:{site.port}/img.png", f"{site.url}/octets"):
        image = load(url, LOOPBACK_ALLOWED)
        assert image.content_hash == content_hash(site.source) and image.format == "PNG"
    assert load(data_url(site.png)).content_hash == content_hash(site.source)  # however it was sent


def test_the_connection_goes_to_the_checked_address_under_the_hosts_name(site, monkeypatch):
    """The name resolves once, to the address that was checked; the request goes there, and the
    Host header still names the host (the system's resolver knows no ``images.test``)."""
    looked_up = []

    async def resolver(host, port):
        looked_up.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(media, "_getaddrinfo", resolver)
    limits = MediaLimits(allowed_domains=("images.test",), allow_private=True)
    image = load(f"http://cdn.images.test:{site.port}/img.png", limits)
    assert image.content_hash == content_hash(site.source)
    assert looked_up == ["cdn.images.test"] and site.hosts == [f"cdn.images.test:{site.port}"]

    async def mixed(host, port):  # a public address alongside a loopback one: refused, nothing is contacted
        return ["1.1.1.1", "127.0.0.1"]

    monkeypatch.setattr(media, "_getaddrinfo", mixed)
    error = refused(f"http://cdn.images.test:{site.port}/img.png", MediaLimits(allowed_domains=("images.test",)))
    assert "resolves to 127.0.0.1, a loopback address" in error.message
    assert site.hits["/img.png"] == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_verifies_the_hosts_certificate_on_the_checked_address(tmp_path, monkeypatch):
    """Over TLS the connection goes to the checked IP, and SNI and the certificate check still name the host."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=images.test",
                    "-addext", "subjectAltName=DNS:images.test"], check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server = serve_images(tls)
    try:
        async def resolver(host, port):
            return ["127.0.0.1"]

        monkeypatch.setattr(media, "_getaddrinfo", resolver)
        monkeypatch.setattr(media, "_ssl_context", lambda: ssl.create_default_context(cafile=str(cert)))
        limits = MediaLimits(allowed_domains=("images.test", "127.0.0.1"), allow_private=True)
        image = load(f"https://images.test:{server.site.port}/img.png", limits)
        assert image.content_hash == content_hash(server.site.source)
        assert server.site.hosts == [f"images.test:{server.site.port}"]
        # The same server by its address: the certificate does not name 127.0.0.1, so it is refused.
        assert "CERTIFICATE_VERIFY_FAILED" in refused(f"{server.site.url}/img.png", limits).message
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path", ["/slow-headers", "/slow-body"])
def test_a_slow_server_times_out(site, path):
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, fetch_timeout_s=0.5)
    started = time.perf_counter()
    assert "timed out after 0.5 s" in refused(f"{site.url}{path}", limits).message
    assert time.perf_counter() - started < 2.0


def test_a_body_over_the_limit_is_refused_while_it_streams(site):
    limits = MediaLimits(allowed_domains=("127.0.0.1",), allow_private=True, max_image_bytes=200_000)
    started = time.perf_counter()
    assert "more than 200000 bytes arrived" in refused(f"{site.url}/endless", limits).message
    assert time.perf_counter() - started < 2.0  # long before the 256 MiB the server would send
    assert "says its Content-Length" in refused(f"{site.url}/declared-huge", limits).message


def test_redirects_are_checked_at_every_hop(site):
    only_localhost = MediaLimits(allowed_domains=("localhost",), allow_private=True)
    base = f"http://localhost:{site.port}"
    error = refused(f"{base}/redirect?to={site.url}/img.png", only_localhost)  # to 127.0.0.1: not allowed
    assert "redirected to" in error.message and "'127.0.0.1'" in error.message
    assert site.hits["/img.png"] == 0
    assert "redirected to a file: URL" in refused(f"{base}/redirect?to=file:///etc/passwd", only_localhost).message
    assert "more than 5 redirects" in refused(f"{base}/loop", only_localhost).message
    image = load(f"{base}/redirect?to=/img.png", only_localhost)  # a relative hop that stays allowed
    assert image.content_hash == content_hash(site.source) and site.hits["/img.png"] == 1


def test_every_hop_is_resolved_and_checked_again(site, monkeypatch):
    looked_up = []

    async def resolver(host, port):
        looked_up.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(media, "_getaddrinfo", resolver)
    limits = MediaLimits(allowed_domains=("first.test", "second.test"), allow_private=True)
    image = load(f"http://first.test:{site.port}/redirect?to=http://second.test:{site.port}/img.png", limits)
    assert image.content_hash == content_hash(site.source)
    assert looked_up == ["first.test", "second.test"]
    assert site.hosts == [f"first.test:{site.port}", f"second.test:{site.port}"]


@pytest.mark.parametrize("path, says", [
    ("/missing.png", "HTTP status 404"), ("/page.html", "not an image (content type 'text/html')"),
    ("/drawing.svg", "an unsupported image type (content type 'image/svg+xml')"),
])
def test_answers_that_are_no_image_are_refused(site, path, says):
    assert says in refused(f"{site.url}{path}", LOOPBACK_ALLOWED).message


def test_fetch_images_keeps_the_order_and_the_count_limit(site):
    refs = [ImageRef(f"{site.url}/img.png", "low", "a"), ImageRef(data_url(encoded(picture(), "PNG")), "auto", "b"),
            ImageRef(f"{site.url}/img.png", "high", "c")]
    images = asyncio.run(fetch_images(refs, LOOPBACK_ALLOWED))
    assert [i.detail for i in images] == ["low", "auto", "high"]
    assert [i.content_hash for i in images] == [content_hash(site.source), content_hash(picture()),
                                                content_hash(site.source)]
    with pytest.raises(APIError, match="at most 2 per request"):
        asyncio.run(fetch_images(refs, MediaLimits(max_images_per_request=2)))


def test_the_pixels_of_all_a_requests_images_are_counted_before_any_is_decoded(site):
    """Three images whose headers declare 7000x7000 (their data is truncated: decoding them fails) are refused
    for their total; under a higher total, the decoding is reached and fails. A fetched image counts too."""
    bomb = ImageRef(data_url(png_declaring(7000, 7000)), "auto", "b")
    fetched = ImageRef(f"{site.url}/img.png", "auto", "f")
    limits = dataclasses.replace(LOOPBACK_ALLOWED, max_request_pixels=3 * 49_000_000)
    with pytest.raises(APIError, match="--max-request-megapixels") as info:
        asyncio.run(fetch_images([bomb, bomb, fetched, bomb], limits))
    width, height = site.source.size
    assert f"{3 * 49_000_000 + width * height:,} pixels together" in info.value.message
    assert info.value.param == "messages" and sum(site.hits.values()) == 1
    with pytest.raises(APIError, match="corrupt or truncated"):
        asyncio.run(fetch_images([bomb], limits))
    exact = dataclasses.replace(limits, max_request_pixels=2 * width * height)
    assert len(asyncio.run(fetch_images([fetched, fetched], exact))) == 2


# --------------------------------------------------------------------------- chat rendering

PARTS_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for c in m.content %}{% if c.type == 'image' %}<image>{% else %}{{ c.text }}{% endif %}"
                  "{% endfor %}{% endif %}{% endfor %}")


def messages_with(*parts, role: str = "user") -> list[ChatMessageParam]:
    return [ChatMessageParam.model_validate({"role": role, "content": list(parts)})]


def image_part(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(default_model_path))


def test_a_text_only_model_refuses_image_parts_before_fetching(site):
    messages = messages_with({"type": "text", "text": "what is this?"}, image_part(f"{site.url}/img.png"))
    with pytest.raises(APIError) as info:
        chat_image_parts(messages, "tiny-llama", accepts_images=False, max_images=16)
    assert "the model 'tiny-llama' does not accept images" in info.value.message
    assert info.value.param == "messages.0.content"
    with pytest.raises(APIError, match="type 'input_audio' are not supported"):
        chat_image_parts(messages_with({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
                         "m", accepts_images=True, max_images=16)
    with pytest.raises(APIError, match="at most 1 per request"):
        chat_image_parts(messages_with(image_part("data:,"), image_part("data:,")), "m", True, max_images=1)
    refs = chat_image_parts(messages, "m", accepts_images=True, max_images=16)
    assert refs == [ImageRef(f"{site.url}/img.png", "auto", PARAM)]
    assert sum(site.hits.values()) == 0  # finding the parts fetches nothing


def test_the_template_gets_huggingface_multimodal_parts(tokenizer):
    first, second = picture(seed=4), picture(seed=5)
    messages = messages_with({"type": "text", "text": "compare"}, image_part(data_url(encoded(first, "PNG"))),
                             {"type": "text", "text": "with"}, image_part(data_url(encoded(second, "PNG")), "low"))
    images = asyncio.run(fetch_images(chat_image_parts(messages, "vlm", True, 16), MediaLimits()))
    options = ChatTemplateOptions(add_generation_prompt=False, chat_template=PARTS_TEMPLATE)
    rendered = render_chat(tokenizer, messages, options, images=images, multimodal=True)
    assert rendered.prompt == "[user]compare<image>with<image>"
    assert rendered.prompt_token_ids == tokenizer(rendered.prompt, add_special_tokens=False)["input_ids"]
    assert [(i.content_hash, i.detail) for i in rendered.images] == [(content_hash(first), "auto"),
                                                                    (content_hash(second), "low")]
    text_only = render_chat(tokenizer, messages_with({"type": "text", "text": "a"}, {"type": "text", "text": "b"}),
                            options)
    assert text_only.prompt == "[user]a\nb" and text_only.images == []
    with pytest.raises(APIError, match="does not accept images"):
        render_chat(tokenizer, messages, options)


def test_a_chat_request_fetches_its_images_only_for_a_model_that_takes_them(tokenizer, site):
    from server.chat import render_chat_request
    from server.serving import ServingContext

    messages = messages_with({"type": "text", "text": "look"}, image_part(f"{site.url}/img.png", "high"))
    options = ChatTemplateOptions(add_generation_prompt=False, chat_template=PARTS_TEMPLATE)
    for accepts_images in (False, True):
        model = SimpleNamespace(name="some-model", accepts_images=accepts_images, tokenizer=tokenizer,
                                chat_template=None, max_model_len=4096)
        ctx = ServingContext(None, model, None, media=LOOPBACK_ALLOWED, trust_request_chat_template=True)
        if not accepts_images:
            with pytest.raises(APIError, match="'some-model' does not accept images"):
                asyncio.run(render_chat_request(ctx, messages, options, None))
            assert sum(site.hits.values()) == 0
            continue
        rendered = asyncio.run(render_chat_request(ctx, messages, options, None))
        assert rendered.prompt == "[user]look<image>" and site.hits["/img.png"] == 1
        assert [(i.content_hash, i.detail) for i in rendered.images] == [(content_hash(site.source), "high")]


# ------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def media_server(tmp_path_factory, tiny_model_path):
    """The tiny (text-only) model, with remote fetching on for 127.0.0.1: if anything fetched, it could."""
    args = tiny_server_args(tiny_model_path) + ["--allowed-media-domains", "127.0.0.1", "localhost",
                                                "--allow-private-media-addresses"]
    server = start_server(tmp_path_factory.mktemp("servers"), "media", args)
    yield server
    server.stop()


@pytest.fixture
def client(media_server):
    return openai.OpenAI(base_url=f"{media_server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.server
def test_the_server_refuses_images_for_a_text_only_model_without_fetching(client, media_server, site):
    content = [{"type": "text", "text": "What is in this picture?"}, image_part(f"{site.url}/img.png")]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=TINY_MODEL_NAME, messages=[{"role": "user", "content": content}],
                                           max_tokens=2, stream=stream)
        assert info.value.status_code == 400
        assert f"the model '{TINY_MODEL_NAME}' does not accept images" in info.value.body["message"]
        assert info.value.body["param"] == "messages.0.content"
    response = httpx.post(f"{media_server.url}/tokenize", json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and "does not accept images" in response.json()["error"]["message"]
    assert sum(site.hits.values()) == 0


@pytest.mark.server
@pytest.mark.parametrize("part, param, says", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages.0.content",
     "'input_audio' are not supported"),
    ({"type": "video_url", "video_url": {"url": "http://127.0.0.1/v.mp4"}}, "messages.0.content",
     "'video_url' are not supported"),
    (image_part("data:,", "bogus"), "messages.0.content.1.image_url.detail", "'auto', 'low' or 'high'"),
    ({"type": "image_url", "image_url": "http://127.0.0.1/x.png"}, "messages.0.content.1.image_url",
     "valid dictionary"),
    ({"type": "image_url"}, "messages.0.content", "needs an 'image_url' object"),
], ids=["input_audio", "video_url", "detail-bogus", "image-url-string", "image-url-missing"])
def test_bad_content_parts_are_400s_naming_them(client, part, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=TINY_MODEL_NAME, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert info.value.body["param"] == param and says in info.value.body["message"], info.value.body


@pytest.mark.server
def test_models_say_they_take_text_only(client, media_server):
    (model,) = client.models.list().data
    assert model.id == TINY_MODEL_NAME and model.model_extra["input_modalities"] == ["text"]
    assert httpx.get(f"{media_server.url}/v1/models/{TINY_MODEL_NAME}").json()["input_modalities"] == ["text"]
    reply = client.chat.completions.create(model=TINY_MODEL_NAME, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "still"}, {"type": "text", "text": "fine"}]}])
    assert reply.choices[0].finish_reason in ("stop", "length")
