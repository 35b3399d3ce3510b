// Line charts of the last few minutes on a canvas, plus the history they draw from: the server sends the whole
// history in a stream's first event and only newer one-second points afterwards; merged here by time.

export const WINDOW_S = 300;

export class History {
  constructor() {
    this.points = []; // {time, prompt_tokens_per_s, ...} sorted by time
  }

  /** Adds the columnar series of a payload ({time: [...], name: [...], ...}). */
  merge(series) {
    const names = Object.keys(series);
    const last = this.points.length ? this.points[this.points.length - 1].time : -Infinity;
    series.time.forEach((time, i) => {
      if (time <= last) return;
      this.points.push(Object.fromEntries(names.map((name) => [name, series[name][i]])));
    });
    const oldest = (this.points.length ? this.points[this.points.length - 1].time : 0) - WINDOW_S;
    while (this.points.length && this.points[0].time < oldest) this.points.shift();
  }

  column(name) {
    return this.points.map((p) => p[name]);
  }
}

/** Draws lines [{values, color}] over `times` (Unix seconds) on the last WINDOW_S seconds up to `now`. */
export function drawChart(canvas, times, lines, now, fixedMax = null) {
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const pad = { left: 34, right: 4, top: 4, bottom: 14 };
  ctx.clearRect(0, 0, width, height);
  const max = fixedMax ?? Math.max(1, ...lines.flatMap((line) => line.values));
  const x = (t) => pad.left + ((t - (now - WINDOW_S)) / WINDOW_S) * (width - pad.left - pad.right);
  const y = (v) => height - pad.bottom - (v / max) * (height - pad.top - pad.bottom);
  ctx.strokeStyle = "#ddd";
  ctx.fillStyle = "#777";
  ctx.font = "10px sans-serif";
  ctx.lineWidth = 1;
  for (const fraction of [0, 0.5, 1]) {
    const value = max * fraction;
    ctx.beginPath();
    ctx.moveTo(pad.left, y(value));
    ctx.lineTo(width - pad.right, y(value));
    ctx.stroke();
    ctx.fillText(value >= 100 ? value.toFixed(0) : +value.toFixed(1), 2, y(value) + 3);
  }
  ctx.fillText(`-${WINDOW_S / 60} min`, pad.left, height - 2);
  ctx.fillText("now", width - pad.right - 20, height - 2);
  ctx.lineWidth = 1.5;
  for (const line of lines) {
    ctx.strokeStyle = line.color;
    ctx.beginPath();
    line.values.forEach((value, i) => {
      if (i === 0) ctx.moveTo(x(times[i]), y(value));
      else ctx.lineTo(x(times[i]), y(value));
    });
    ctx.stroke();
  }
}
