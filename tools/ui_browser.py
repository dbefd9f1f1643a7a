"""What tools/ui_check.py drives the browser with: headless Chromium, a screenshot of a page (a tab clicked, a
search typed first), the page's text, whether its widest table fits the window, and the report of checks."""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROME_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1920,1200",
]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    for binary in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if Path(binary).exists():
            options.binary_location = binary
    driver_path = next(
        (p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver") if Path(p).exists()), None
    )
    service = Service(executable_path=driver_path) if driver_path else Service()
    return webdriver.Chrome(options=options, service=service)


def shoot(driver, url: str, path: Path, settle: float = 6.0, search: str | None = None, tab: str | None = None) -> None:
    """A screenshot of `url`; with `search`, typed into the page's first search box first (MLflow's chart filter);
    with `tab`, the tab of that name clicked and scrolled to first."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    time.sleep(settle)  # both UIs render client-side: let them fetch and draw
    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):  # MLflow's assistant panel
        try:
            if button.is_displayed():
                button.click()
                time.sleep(1.0)
        except Exception:  # noqa: BLE001 (a panel that is not there, or moved: the screenshot is taken anyway)
            pass
    if tab:  # Prefect's tabs are <li class="p-tab">
        xpath = f"//*[(self::button or self::a or @role='tab' or self::li) and normalize-space(.)='{tab}']"
        found = [element for element in driver.find_elements(By.XPATH, xpath) if element.is_displayed()]
        if found:
            driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", found[0])
            found[0].click()
            time.sleep(3.0)
    if search:
        boxes = driver.find_elements(By.CSS_SELECTOR, "input[placeholder*='Search']")
        if boxes:
            boxes[0].send_keys(search)
            time.sleep(2.0)
    driver.save_screenshot(str(path))
    print(f"ui-check: {path.relative_to(REPO)}  <- {url}", flush=True)


class Checks:
    """What the user should see, each a line of the report; any failure makes the exit code 1."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> bool:
        print(f"ui-check: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            self.failed.append(what)
        return ok


def page_text(driver) -> str:
    return driver.execute_script("return document.body.innerText")


def overflow(driver) -> int:
    """How many pixels the page, or its widest table or scrolling box, is wider than the window (0: it fits, no
    horizontal scrolling)."""
    return driver.execute_script(
        """
        const width = document.documentElement.clientWidth;
        let worst = document.documentElement.scrollWidth - width;
        for (const e of document.querySelectorAll('table, pre, [class*="table"], [class*="scroll"]')) {
          if (e.offsetParent === null) continue;
          worst = Math.max(worst, e.scrollWidth - e.clientWidth, e.getBoundingClientRect().right - width);
        }
        return Math.max(0, Math.round(worst));
        """
    )
