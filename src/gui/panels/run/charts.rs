//! The Run panel's charts: the loss (smoothed, with evaluation, divergences and past runs
//! overlaid), GRPO's rewards, the learning rate and each device's memory.

use eframe::egui::{self, RichText, Ui};
use egui_plot::{HLine, Legend, Line, LineStyle, Plot, PlotPoints, Points};

use super::RunPanel;
use crate::gui::session::Session;
use crate::gui::theme;

/// Exponential moving average (as TensorBoard's smoothing slider).
pub fn smooth(points: &[[f64; 2]], weight: f64) -> Vec<[f64; 2]> {
    let mut out = Vec::with_capacity(points.len());
    let mut last: Option<f64> = None;
    for p in points {
        let v = match last {
            None => p[1],
            Some(prev) => prev * weight + p[1] * (1.0 - weight),
        };
        last = Some(v);
        out.push([p[0], v]);
    }
    out
}

pub(super) fn loss_chart(ui: &mut Ui, rp: &mut RunPanel, s: &mut Session) {
    ui.horizontal(|ui| {
        ui.label(RichText::new("Loss").size(15.0).strong());
        ui.add_space(20.0);
        let l = ui.label("Smoothing");
        ui.add(
            egui::DragValue::new(&mut s.settings.smoothing)
                .range(0.0..=0.99)
                .speed(0.01),
        )
        .labelled_by(l.id)
        .on_hover_text("Exponential moving average of the training loss (0 = raw)");
    });
    let w = s.settings.smoothing as f64;
    let run = &rp.live;
    // (name, train loss, eval loss) of each overlaid run.
    type Curves = (String, Vec<[f64; 2]>, Vec<[f64; 2]>);
    let overlays: Vec<Curves> = rp
        .history
        .overlay
        .iter()
        .filter_map(|&i| rp.history.runs.get(i))
        .map(|h| {
            let pts = |v: &[(u64, f64)]| {
                v.iter()
                    .filter(|p| p.1.is_finite())
                    .map(|&(x, y)| [x as f64, y])
                    .collect()
            };
            (h.name(), pts(&h.curves.loss), pts(&h.curves.eval_loss))
        })
        .collect();
    Plot::new("loss-chart")
        .height(240.0)
        .legend(Legend::default())
        .x_axis_label("step")
        .y_axis_label("loss")
        .allow_scroll(false)
        .show(ui, |plot| {
            if !run.loss.is_empty() {
                plot.line(
                    Line::new("train (raw)", PlotPoints::from(run.loss.clone()))
                        .color(theme::ACCENT.gamma_multiply(0.35))
                        .width(1.0),
                );
                plot.line(
                    Line::new("train", PlotPoints::from(smooth(&run.loss, w)))
                        .color(theme::ACCENT)
                        .width(2.0),
                );
            }
            if !run.eval_loss.is_empty() {
                plot.line(
                    Line::new("eval", PlotPoints::from(run.eval_loss.clone()))
                        .color(theme::MEM_ACTIVATIONS)
                        .width(2.0),
                );
                plot.points(
                    Points::new("eval", PlotPoints::from(run.eval_loss.clone()))
                        .color(theme::MEM_ACTIVATIONS)
                        .radius(3.5),
                );
            }
            // The divergence watch's spikes (`train::divergence`).
            if !run.divergences.is_empty() {
                plot.points(
                    Points::new("diverged", PlotPoints::from(run.divergences.clone()))
                        .color(theme::ERROR)
                        .radius(6.0),
                );
            }
            for (i, (name, loss, eval)) in overlays.into_iter().enumerate() {
                let c = theme::SERIES[(i + 2) % theme::SERIES.len()];
                if !loss.is_empty() {
                    plot.line(
                        Line::new(format!("{name} train"), PlotPoints::from(smooth(&loss, w)))
                            .color(c)
                            .style(LineStyle::dashed_loose()),
                    );
                }
                if !eval.is_empty() {
                    plot.line(
                        Line::new(format!("{name} eval"), PlotPoints::from(eval))
                            .color(c)
                            .style(LineStyle::dotted_dense()),
                    );
                }
            }
        });
}

/// GRPO's rewards by step: the weighted mean (`reward`) and each function's mean, raw (a
/// step's group means are already averaged over its prompts).
pub(super) fn reward_chart(ui: &mut Ui, rp: &RunPanel) {
    Plot::new("reward-chart")
        .height(200.0)
        .legend(Legend::default())
        .x_axis_label("step")
        .y_axis_label("reward")
        .allow_scroll(false)
        .show(ui, |plot| {
            for (i, (name, points)) in rp.live.rewards.iter().enumerate() {
                let (color, width) = if name == "reward" {
                    (theme::OK, 2.5)
                } else {
                    (theme::SERIES[(i + 1) % theme::SERIES.len()], 1.5)
                };
                plot.line(
                    Line::new(name.clone(), PlotPoints::from(points.clone()))
                        .color(color)
                        .width(width),
                );
            }
        });
}

pub(super) fn lr_chart(ui: &mut Ui, rp: &RunPanel) {
    Plot::new("lr-chart")
        .height(170.0)
        .x_axis_label("step")
        .allow_scroll(false)
        .y_axis_formatter(|m, _| format!("{:.0e}", m.value))
        .show(ui, |plot| {
            if !rp.live.lr.is_empty() {
                plot.line(
                    Line::new("learning rate", PlotPoints::from(rp.live.lr.clone()))
                        .color(theme::MEM_GRADIENTS)
                        .width(2.0),
                );
            }
        });
}

pub(super) fn memory_chart(ui: &mut Ui, rp: &RunPanel) {
    let mem = &rp.live.memory;
    Plot::new("memory-chart")
        .height(170.0)
        .legend(Legend::default())
        .x_axis_label("step")
        .y_axis_label("GiB")
        .allow_scroll(false)
        .include_y(0.0)
        .show(ui, |plot| {
            for (i, (device, series)) in mem.iter().enumerate() {
                let c = theme::SERIES[i % theme::SERIES.len()];
                if !series.used.is_empty() {
                    let whose = match series.scope {
                        tunestudio::train::MemoryScope::Process => "used",
                        tunestudio::train::MemoryScope::Device => "used (whole device)",
                    };
                    plot.line(
                        Line::new(
                            format!("{device} {whose}"),
                            PlotPoints::from(series.used.clone()),
                        )
                        .color(c)
                        .width(2.0),
                    );
                }
                if let Some(p) = series.predicted_peak_bytes {
                    plot.hline(
                        HLine::new(format!("{device} predicted peak"), theme::gib(p))
                            .color(c)
                            .style(LineStyle::dashed_loose()),
                    );
                }
                // A capacity far above the use would flatten the curves to the axis.
                let top = series
                    .peak_bytes
                    .max(series.predicted_peak_bytes.unwrap_or(0));
                if let Some(t) = series.total_bytes.filter(|&t| t <= top.saturating_mul(4)) {
                    plot.hline(
                        HLine::new(format!("{device} capacity"), theme::gib(t))
                            .color(theme::ERROR)
                            .width(1.5),
                    );
                }
            }
        });
    // One caption per line of the chart, so each device's figures read on their own.
    let peaks: Vec<String> = mem
        .iter()
        .filter(|(_, v)| v.peak_bytes > 0)
        .map(|(d, v)| {
            format!(
                "{d}: peak {}{}{}",
                theme::bytes(v.peak_bytes),
                v.predicted_peak_bytes
                    .map(|p| format!(
                        " (predicted {}, {:+.1} %)",
                        theme::bytes(p),
                        100.0 * (p as f64 - v.peak_bytes as f64) / v.peak_bytes as f64
                    ))
                    .unwrap_or_default(),
                v.total_bytes
                    .map(|t| format!(" of {}", theme::bytes(t)))
                    .unwrap_or_default()
            )
        })
        .collect();
    ui.horizontal_wrapped(|ui| {
        for p in peaks {
            ui.label(RichText::new(p).small().weak());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::smooth;

    #[test]
    fn smoothing_is_an_ema() {
        let pts = [[1.0, 4.0], [2.0, 2.0], [3.0, 2.0]];
        assert_eq!(smooth(&pts, 0.0), pts.to_vec());
        let s = smooth(&pts, 0.5);
        assert_eq!(s[0], [1.0, 4.0]);
        assert_eq!(s[1], [2.0, 3.0]);
        assert_eq!(s[2], [3.0, 2.5]);
    }
}
