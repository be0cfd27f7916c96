// Drives the chat page at BASE_URL in headless Chromium (puppeteer-core): types a message,
// sends it with Enter, waits for the streamed reply and checks it against EXPECTED.
// Usage: node page_test.mjs BASE_URL EXPECTED_REPLY CHROMIUM_PATH
import puppeteer from "puppeteer-core";

const [base, expected, executablePath] = process.argv.slice(2);
let passed = 0, failed = 0;
function check(name, ok, detail) {
  if (ok) { passed++; console.log(`ok   ${name}`); }
  else { failed++; console.log(`FAIL ${name}: ${detail}`); }
}

const browser = await puppeteer.launch({
  executablePath, headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", e => errors.push(String(e)));
  await page.goto(base + "/", {waitUntil: "networkidle0"});
  const model = await page.$eval("#model", e => e.textContent);
  check("model name shown", model.length > 0, JSON.stringify(model));

  await page.type("#input", "Say hello");
  await page.keyboard.press("Enter");
  await page.waitForSelector('.msg.assistant[data-state="done"]', {timeout: 30000});
  const msgs = await page.$$eval(".msg", ds => ds.map(d => [d.className, d.textContent]));
  check("user message shown", msgs.length >= 1 && msgs[0][0] === "msg user" && msgs[0][1] === "Say hello",
        JSON.stringify(msgs));
  check("streamed reply shown as text", msgs.length === 2 && msgs[1][0] === "msg assistant" && msgs[1][1] === expected,
        JSON.stringify(msgs));
  const meta = await page.$eval(".meta", e => e.textContent).catch(() => "");
  check("usage line", /^\d+ prompt tokens \(\d+ cached\), \d+ generated$/.test(meta), JSON.stringify(meta));
  check("no script errors", errors.length === 0, errors.join("; "));
  check("input re-enabled", await page.$eval("#send", b => !b.disabled), "send stays disabled");
} finally {
  await browser.close();
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
