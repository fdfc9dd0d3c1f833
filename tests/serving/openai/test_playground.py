"""The playground page (/ui): served open (an API key is asked for in the page, not at the door),
off with `ui=False` (`serve --no-ui`), and working in a real browser: headless Chromium loads it
from a server on loopback over SmolLM2, sends a message, sees the reply stream in, and the panel
shows the tokens the server generated. Chromium and its driver are Debian's packages: installed
by this module's setup where it can (root with apt-get), skipped with the reason where not.

JAXINFER_PLAYGROUND_SCREENSHOT=PATH saves the page as the browser shows it after the reply
(docs/assets/playground.png is one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from serving_support import assert_pages_free
from testpaths import SMOLLM2_SMALL

from jaxinfer.llm import LLM
from serving.server import BackgroundServer, ServerOptions

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def get(url: str, headers: dict | None = None) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as reply:
            return reply.status, reply.headers.get("content-type", ""), reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def test_the_page_is_open_and_off_on_request(serve):
    server = serve(port=None, http_port=0, api_keys=("sekrit",))
    base = f"http://127.0.0.1:{server.http_port}"
    status, kind, page = get(f"{base}/ui")
    assert status == 200 and kind.startswith("text/html") and "jaxinfer playground" in page
    assert "http://" not in page and "https://" not in page  # nothing fetched from elsewhere
    assert get(f"{base}/v1/models")[0] == 401  # the API itself still asks for the key
    assert get(f"{base}/v1/models", {"Authorization": "Bearer sekrit"})[0] == 200
    server.stop()
    off = serve(port=None, http_port=0, ui=False)
    assert get(f"http://127.0.0.1:{off.http_port}/ui")[0] == 404


def _chromium() -> None:
    """Debian's chromium and chromium-driver, installed here if they are missing and can be."""
    if os.path.exists(CHROMIUM) and os.path.exists(DRIVER):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("no Chromium: install Debian's chromium and chromium-driver (needs root and apt-get)")
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"], capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0 or not os.path.exists(DRIVER):
        pytest.skip(f"no Chromium: apt-get install chromium chromium-driver failed: {done.stderr[-500:]}")


@pytest.fixture(scope="module")
def browser():
    _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,700",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def smollm2_server():
    llm = LLM(**SMOLLM2_SMALL)
    server = BackgroundServer(llm.engine, ServerOptions(port=None, http_port=0, grace_period_s=2.0)).start()
    yield f"http://127.0.0.1:{server.http_port}"
    server.stop()
    assert_pages_free(server.server.engine_loop.engine)


def test_a_chat_streams_into_the_page_and_the_panel_follows(browser, smollm2_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{smollm2_server}/ui")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda b: b.find_element(By.ID, "model").text not in ("", "…"))
    assert "SmolLM2" in browser.find_element(By.ID, "model").text
    browser.find_element(By.ID, "temperature").clear()
    browser.find_element(By.ID, "temperature").send_keys("0")
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("12")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("What is the capital of France?")
    prompt.send_keys(Keys.ENTER)
    wait.until(lambda b: b.find_element(By.ID, "send").is_enabled() and b.find_elements(By.CSS_SELECTOR, ".assistant"))
    replies = browser.find_elements(By.CSS_SELECTOR, ".assistant")
    assert not browser.find_elements(By.CSS_SELECTOR, ".error")
    assert replies[-1].text.strip(), "no streamed text arrived"
    assert browser.find_elements(By.CSS_SELECTOR, ".user")[-1].text == "What is the capital of France?"
    # The panel reads /metrics each second: the reply's tokens show up as generated.
    wait.until(lambda b: b.find_element(By.ID, "generated").text not in ("-", "0"))
    assert int(browser.find_element(By.ID, "generated").text) >= 1
    assert browser.find_element(By.ID, "running").text in ("0", "1")
    if path := os.environ.get("JAXINFER_PLAYGROUND_SCREENSHOT"):
        browser.save_screenshot(path)


def test_a_bad_schema_is_named_in_the_page(browser, smollm2_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{smollm2_server}/ui")
    wait = WebDriverWait(browser, 60)
    wait.until(lambda b: b.find_element(By.ID, "model").text not in ("", "…"))
    browser.find_element(By.ID, "schema").send_keys("{not json")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Hello")
    prompt.send_keys(Keys.ENTER)
    wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, ".error"))
    assert "JSON schema" in browser.find_element(By.CSS_SELECTOR, ".error").text


def test_a_json_schema_constrains_the_reply(browser, smollm2_server):
    import json

    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{smollm2_server}/ui")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda b: b.find_element(By.ID, "model").text not in ("", "…"))
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    }
    browser.find_element(By.ID, "max_tokens").clear()
    browser.find_element(By.ID, "max_tokens").send_keys("40")
    browser.find_element(By.ID, "schema").send_keys(json.dumps(schema))
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Which city is the capital of France?")
    prompt.send_keys(Keys.ENTER)
    wait.until(lambda b: b.find_element(By.ID, "send").is_enabled() and b.find_elements(By.CSS_SELECTOR, ".assistant"))
    assert not browser.find_elements(By.CSS_SELECTOR, ".error")
    reply = json.loads(browser.find_elements(By.CSS_SELECTOR, ".assistant")[-1].text)
    assert set(reply) == {"city"} and isinstance(reply["city"], str)
