// syncscope status page: re-fetch the server-rendered body every few seconds and swap it in.
// Screen readers hear only changes of the headline (a new straggler, or none), not every refresh.
(() => {
  "use strict";
  const body = document.getElementById("status");
  const conn = document.getElementById("conn");
  const announce = document.getElementById("announce");
  const pause = document.getElementById("pause");
  if (!body) return;
  const period = Number(body.dataset.refreshMs) || 2000;
  let paused = false;
  let timer = 0;
  const headlineOf = () => {
    const el = body.querySelector("[data-headline]");
    return el ? el.dataset.headline : "";
  };
  let headline = headlineOf();

  const schedule = () => {
    clearTimeout(timer);
    timer = setTimeout(refresh, period);
  };

  async function refresh() {
    if (paused || document.hidden) return schedule();
    try {
      const reply = await fetch("ui/status", { cache: "no-store" });
      if (!reply.ok) throw new Error("HTTP " + reply.status);
      body.innerHTML = await reply.text();
      conn.hidden = true;
      conn.textContent = "";
      const now = headlineOf();
      if (now !== headline) {
        headline = now;
        announce.textContent = now;
      }
      body.dataset.refreshed = String(Date.now());
    } catch (err) {
      conn.hidden = false;
      conn.textContent =
        "⚠ Exporter unreachable (" + err.message + "): showing the last data received; retrying.";
    }
    schedule();
  }

  pause.addEventListener("click", () => {
    paused = !paused;
    pause.setAttribute("aria-pressed", String(paused));
    pause.textContent = paused ? "Resume updates" : "Pause updates";
    if (!paused) refresh();
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !paused) refresh();
  });
  body.dataset.live = "1";
  schedule();
})();
