"""The fleet page renders the fleet in a real browser and follows engine state live."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

from playwright.async_api import Browser, Dialog, Page, expect

from narwhal.config.secrets import Secrets
from narwhal.control.controller import Observation, PhaseLoad
from narwhal.fleet.lifecycle import Event
from narwhal.http.page import ASSET_TYPES
from support.stack import COMPLETION, Stack, StackFactory, arm

FOUR = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode"))
# The page polls every second; allow a few polls.
LIVE_MS = 5000


async def open_page(browser: Browser, stack: Stack, path: str, width: int, height: int) -> Page:
    """The page, failing the test on any console error (a blocked asset included)."""
    page = await browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    await page.goto(stack.url + path)
    await expect(page.locator("[data-engine]")).to_have_count(len(stack.fleet.engines))
    assert errors == []
    return page


async def test_the_page_shows_the_fleet_and_follows_quarantine_and_ejection(
    make_stack: StackFactory, browser: Browser
) -> None:
    async with make_stack(FOUR, recovery={"failure_quarantine_s": 30.0}) as stack:
        for _ in range(3):
            assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        page = await open_page(browser, stack, "/", 1280, 800)

        for engine, role in FOUR:
            card = page.locator(f'[data-engine="{engine}"]')
            await expect(card.locator('[data-field="role"]')).to_have_text(role)
            await expect(card.locator('[data-field="state"]')).to_have_text("admitted")
        seats = page.locator('[data-engine="d0"] [data-field="seats-decode"]')
        await expect(seats).to_contain_text("0/256")
        await expect(page.locator('[data-outcome="ok"]')).to_have_text("ok 3")
        await expect(page.locator("#ttft td").first).to_have_text(re.compile(r"^\d+ ms$"))
        await expect(page.locator("#status")).to_have_text("serving")

        # A real engine fault quarantines p0; the page shows it and the fresh failure.
        arm(stack.engine("p0"), phase="prefill", status=503, times=1)
        arm(stack.engine("p1"), phase="prefill", status=503, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        failed = next(
            e.id for e in stack.server.router.fleet.engines if e.failures.get("http_status")
        )
        card = page.locator(f'[data-engine="{failed}"]')
        await expect(card.locator('[data-field="state"]')).to_have_text(
            "quarantined", timeout=LIVE_MS
        )
        await expect(card.locator('[data-field="reason"]')).to_contain_text("quarantined for")
        await expect(card.locator('[data-field="failures"]')).to_contain_text(
            "http status+1 recently · 1"
        )
        await expect(page.locator("#status")).to_contain_text("degraded: 1 of 4 engines out")

        # An ejection, set on the router's own fleet (behind its listeners' backs), with
        # its reason.
        d1 = stack.server.router.fleet.by_id["d1"]
        d1.lifecycle.apply(Event.EJECT, lambda _: None)
        d1.ejection_reason = "3 consecutive failures; last: silence: <b>went quiet</b>"
        card = page.locator('[data-engine="d1"]')
        await expect(card.locator('[data-field="state"]')).to_have_text("ejected", timeout=LIVE_MS)
        # Shown as text, never as markup.
        await expect(card.locator('[data-field="reason"]')).to_have_text(d1.ejection_reason)
        await expect(page.locator("#status")).to_contain_text("2 of 4 engines out")
        d1.lifecycle.apply(Event.READMIT, lambda _: None)
        await expect(card.locator('[data-field="state"]')).to_have_text("admitted", timeout=LIVE_MS)


async def test_the_page_shows_a_fleet_serving_degraded_by_fallback_not_down(
    make_stack: StackFactory, browser: Browser
) -> None:
    async with make_stack(recovery={"eject_after": 1}) as stack:
        await stack.engine("p0").crash()
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 200
        page = await open_page(browser, stack, "/", 1280, 800)
        await expect(page.locator("#status")).to_have_text("degraded: 1 of 2 engines out")
        await expect(page.locator('[data-handoff="fallback"]')).to_have_text("fallback 1")
        card = page.locator('[data-engine="p0"]')
        await expect(card.locator('[data-field="state"]')).to_have_text("ejected")


async def test_the_page_shows_a_producers_abandoned_handoffs(
    make_stack: StackFactory, browser: Browser
) -> None:
    async with make_stack() as stack:
        page = await open_page(browser, stack, "/", 1280, 800)
        card = page.locator('[data-engine="p0"]')
        await expect(card.locator('[data-field="abandoned"]')).to_have_count(0)
        # The consumer refuses the decode: the router releases the blocks p0 held for it.
        arm(stack.engine("d0"), phase="decode", status=503, times=1)
        assert (await stack.post("/v1/completions", COMPLETION))[0] == 502
        (line,) = await stack.journal(kind="request")
        blocks = line["abandoned_handoffs"]["blocks"]
        assert blocks > 0
        await expect(card.locator('[data-field="abandoned"]')).to_have_text(
            f"abandoned handoffs 1 · {blocks} blocks · 1 released · 0 pinned now",
            timeout=LIVE_MS,
        )
        assert stack.engine("p0").held_block_count() == 0
        await expect(page.locator('[data-engine="d0"] [data-field="abandoned"]')).to_have_count(0)


async def test_the_page_fits_a_phone_screen(make_stack: StackFactory, browser: Browser) -> None:
    async with make_stack(FOUR) as stack:
        page = await open_page(browser, stack, "/narwhal/", 390, 844)
        overflow = await page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        lefts = {
            round((await card.bounding_box() or {"x": -1.0})["x"])
            for card in await page.locator("[data-engine]").all()
        }
    assert overflow <= 0
    # One column of engine cards.
    assert len(lefts) == 1


async def test_the_page_and_its_assets_come_from_the_router_alone(
    make_stack: StackFactory,
) -> None:
    async with make_stack() as stack:
        bodies = []
        for path in ("/", "/narwhal", "/narwhal/", *(f"/narwhal/static/{a}" for a in ASSET_TYPES)):
            async with stack.http.get(stack.url + path) as response:
                assert response.status == 200, path
                assert "default-src 'self'" in response.headers["Content-Security-Policy"]
                bodies.append(await response.text())
        async with stack.http.get(stack.url + "/narwhal/static/secrets.txt") as response:
            assert response.status == 404
    assert bodies[0] == bodies[1] == bodies[2] and "<title>Narwhal fleet</title>" in bodies[0]
    for body in bodies:
        assert not re.search(r"(src|href)=\"https?:", body)
        assert "cdn" not in body.lower()


async def dismiss(dialog: Dialog) -> None:
    await dialog.dismiss()


async def test_drain_and_readmit_buttons_use_the_admin_key_the_page_asked_for(
    make_stack: StackFactory, browser: Browser
) -> None:
    key = "sk-admin-4444444444"
    async with make_stack(FOUR, secrets=Secrets(admin_keys=(key.encode(),))) as stack:
        page = await browser.new_page(viewport={"width": 1280, "height": 800})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        asked: list[str] = []

        async def answer(dialog: Dialog) -> None:
            asked.append(dialog.type)
            await dialog.accept(key if dialog.type == "prompt" else None)

        page.on("dialog", answer)
        await page.goto(stack.url + "/")
        card = page.locator('[data-engine="d1"]')
        await expect(card.locator('[data-field="state"]')).to_have_text("admitted", timeout=LIVE_MS)
        assert asked == ["prompt"]

        await card.locator('[data-action="drain"]').click()
        await expect(card.locator('[data-field="state"]')).to_have_text("drained", timeout=LIVE_MS)
        await expect(page.locator("#notice")).to_contain_text("drain d1: now drained")
        assert stack.server.router.fleet.by_id["d1"].draining
        # Drained on purpose is not out of service.
        await expect(page.locator("#status")).to_have_text("serving", timeout=LIVE_MS)

        # The last decode engine: refused at the floor, then forced on the operator's word.
        d0 = page.locator('[data-engine="d0"]')
        page.remove_listener("dialog", answer)
        page.once("dialog", dismiss)
        await d0.locator('[data-action="drain"]').click()
        await expect(page.locator("#notice")).to_contain_text("drain d0 refused")
        await expect(page.locator("#notice")).to_contain_text("no admitted engine to decode")
        assert not stack.server.router.fleet.by_id["d0"].draining

        await card.locator('[data-action="readmit"]').click()
        await expect(card.locator('[data-field="state"]')).to_have_text("admitted", timeout=LIVE_MS)
        await expect(page.locator("#notice")).to_contain_text("readmit d1: now admitted")
        events = [line["event"] for line in await stack.journal(3, kind="engine")]
        assert events == ["draining", "drained", "readmitted"]
        assert errors == []


async def test_the_page_shows_roles_and_the_role_controllers_moves(
    make_stack: StackFactory, browser: Browser
) -> None:
    roles = (("a", "both"), ("b", "both"), ("c", "both"))
    starts = {
        "a": {"start_as": "prefill"},
        "b": {"start_as": "decode"},
        "c": {"start_as": "decode"},
    }
    controller = {"enabled": True, "interval_s": 3600.0, "dwell_s": 0.0, "min_samples": 1}
    async with make_stack(roles, engine_keys=starts, controller=controller) as stack:
        page = await open_page(browser, stack, "/", 1280, 800)
        await expect(page.locator("#controller")).to_be_visible()
        await expect(page.locator('[data-engine="b"] [data-field="role"]')).to_have_text(
            "both: decode"
        )
        # One decision on a made-up observation: prefill well over its objective.
        loop = stack.server.router.controller
        assert loop is not None
        real = loop.observe

        def pressured(now: float) -> Observation:
            seen = real(now)
            return replace(seen, prefill=PhaseLoad(10.0, 50), decode=PhaseLoad(0.001, 50))

        loop.source = pressured
        decision = loop.step(asyncio.get_running_loop().time())
        assert decision.move is not None
        moved = decision.move.engine
        card = page.locator(f'[data-engine="{moved}"]')
        await expect(card.locator('[data-field="role"]')).to_have_text(
            "both: prefill", timeout=LIVE_MS
        )
        await expect(page.locator("#controller-split")).to_have_text(
            "2 prefill · 1 decode · 0 both"
        )
        await expect(page.locator("#controller-timeline li")).to_contain_text(
            f"{moved} decode → prefill (ttft_pressure)"
        )


async def test_the_page_hides_the_controller_when_it_is_off(
    make_stack: StackFactory, browser: Browser
) -> None:
    async with make_stack(FOUR) as stack:
        page = await open_page(browser, stack, "/", 1280, 800)
        await expect(page.locator("#controller")).to_be_hidden()
