/*
 * test_config.c — the configuration's C rules that no spec reaches through the Lua library:
 *
 * 1. in_proj_dim (SPEC.md §1: 2 d_inner + 2 G N + 3 H + S) is held to at most INT32_MAX / 2 by
 *    m3_config_validate, with an error naming it, at its exact edge: d_model 64, expand 1, headdim 1 (H = 64),
 *    ngroups 64, rope_fraction 0 (S = 0) give in_proj_dim = 128 N + 320, which is 2^30 - 64 at
 *    N = 2^23 - 3 (accepted) and 2^30 + 64 at N = 2^23 - 2 (refused); the model's parameters stay far below 2^53.
 * 2. m3_config_from_json checks a stated num_rope_angles against the one the fields give (SPEC.md §1's examples:
 *    N = 16 -> S = 4; N = 14, split 7 minus 1 -> S = 3).
 * 3. The layout (SPEC.md §2): out_proj starts U(+-1/sqrt(d_inner)) / sqrt(n_layers), within that bound and (256
 *    draws) reaching past 0.8 of it; a tensor is found under its "backbone." name too (m3.h m3_weights_find).
 */
#include "harness.h"

static m3_config wide_groups(int32_t d_state) {
  m3_config c;
  m3_config_defaults(&c);
  c.d_model = 64;
  c.n_layers = 1;
  c.expand = 1;
  c.headdim = 1;
  c.ngroups = 64;
  c.rope_fraction = 0;
  c.d_state = d_state;
  c.input = M3_INPUT_IDENTITY;
  return c;
}

static void in_proj_dim_edge(void) {
  m3_config c = wide_groups((1 << 23) - 3);
  m3_config_derived d;
  CHECK_OK(m3_config_derive(&c, &d));
  CHECK(d.in_proj_dim == (1 << 30) - 64, "in_proj_dim at N = 2^23 - 3: %d, expected %d", d.in_proj_dim,
        (1 << 30) - 64);
  c = wide_groups((1 << 23) - 2);
  m3_status st = m3_config_validate(&c);
  CHECK(st == M3_ERR_CONFIG && strstr(m3_last_error(), "in_proj_dim = 1073741888 is too large"),
        "in_proj_dim 2^30 + 64 refused: %s '%s'", m3_status_name(st), m3_last_error());
}

static void stated_rope_angles(void) {
  static const struct {
    int d_state, angles, ok;
  } cases[] = {{16, 4, 1}, {16, 5, 0}, {16, 8, 0}, {14, 3, 1}, {14, 4, 0}};
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    char json[256];
    snprintf(json, sizeof json,
             "{\"d_model\": 16, \"n_layers\": 1, \"d_state\": %d, \"headdim\": 8, \"input\": \"identity\", "
             "\"num_rope_angles\": %d}",
             cases[i].d_state, cases[i].angles);
    m3_config c;
    m3_status st = m3_config_from_json(json, &c);
    if (cases[i].ok)
      CHECK(st == M3_OK && c.d_state == cases[i].d_state, "d_state %d with num_rope_angles %d: %s", cases[i].d_state,
            cases[i].angles, m3_last_error());
    else
      CHECK(st == M3_ERR_CONFIG && strstr(m3_last_error(), "num_rope_angles"),
            "d_state %d with num_rope_angles %d refused: %s '%s'", cases[i].d_state, cases[i].angles,
            m3_status_name(st), m3_last_error());
  }
}

static void layout_rules(void) {
  m3_config c = test_config(4, 8, 4, 1, 0.5, 0, M3_INPUT_IDENTITY, M3_HEAD_NONE, 0); /* d_inner 16, 2 layers */
  m3_weights *w = NULL;
  CHECK_OK(m3_weights_create(&c, &w));
  CHECK_OK(m3_weights_init(w, 21));
  const double bound = 1 / sqrt(16.0) / sqrt(2.0);
  double most = 0;
  for (int l = 0; l < 2; l++) {
    char name[64];
    snprintf(name, sizeof name, "layers.%d.mixer.out_proj.weight", l);
    m3_tensor_info t;
    CHECK_OK(m3_weights_tensor(w, m3_weights_find(w, name), &t));
    for (int64_t i = 0; i < t.numel; i++) most = fmax(most, fabs(t.data[i]));
  }
  CHECK(most <= bound && most > 0.8 * bound, "out_proj init: max |x| = %g, expected within (0.8, 1] x %g", most,
        bound);
  const int32_t bare = m3_weights_find(w, "norm_f.weight");
  CHECK(bare >= 0 && m3_weights_find(w, "backbone.norm_f.weight") == bare,
        "backbone.norm_f.weight is norm_f.weight (%d vs %d)", m3_weights_find(w, "backbone.norm_f.weight"), bare);
  m3_weights_destroy(w);
}

int main(void) {
  layout_rules();
  in_proj_dim_edge();
  stated_rope_angles();
  return harness_finish("config");
}
