package deploy

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
	"unicode"
)

// selector is a metric a PromQL expression reads, with the labels its
// matchers name.
type selector struct {
	metric string
	labels []string
}

// promqlKeywords are words of PromQL that are not metric names where they
// stand without a "(" after them.
var promqlKeywords = map[string]bool{
	"and": true, "or": true, "unless": true, "by": true, "without": true, "on": true, "ignoring": true,
	"group_left": true, "group_right": true, "offset": true, "bool": true, "inf": true, "nan": true, "atan2": true,
}

// aggregations may be followed by "by (...)" or "without (...)" before
// their "(".
var aggregations = map[string]bool{
	"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true, "count": true,
	"count_values": true, "bottomk": true, "topk": true, "quantile": true, "limitk": true, "limit_ratio": true,
}

// labelLists are the words followed by a parenthesised list of label names.
var labelLists = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true}

// selectors lists the metric selectors of a PromQL expression (as Grafana
// stores it, with $variables): enough of PromQL's lexer to tell metric
// names from functions, keywords, label names, strings, durations and
// numbers. A dashboard's expressions are small; a full parser would bring
// Prometheus itself in as a dependency.
func selectors(expr string) ([]selector, error) {
	var out []selector
	rs := []rune(expr)
	i := 0
	peek := func() rune {
		for j := i; j < len(rs); j++ {
			if !unicode.IsSpace(rs[j]) {
				return rs[j]
			}
		}
		return 0
	}
	skipTo := func(open, close rune) error { // i at open
		depth := 0
		for ; i < len(rs); i++ {
			switch rs[i] {
			case open:
				depth++
			case close:
				depth--
				if depth == 0 {
					i++
					return nil
				}
			case '"', '\'', '`':
				if err := skipString(rs, &i); err != nil {
					return err
				}
				i--
			}
		}
		return fmt.Errorf("unbalanced %c in %q", open, expr)
	}
	isIdentStart := func(r rune) bool { return r == '_' || r == ':' || unicode.IsLetter(r) }
	isIdent := func(r rune) bool { return isIdentStart(r) || unicode.IsDigit(r) }
	for i < len(rs) {
		r := rs[i]
		switch {
		case unicode.IsSpace(r):
			i++
		case r == '"' || r == '\'' || r == '`':
			if err := skipString(rs, &i); err != nil {
				return nil, fmt.Errorf("%w in %q", err, expr)
			}
		case r == '[':
			if err := skipTo('[', ']'); err != nil {
				return nil, err
			}
		case r == '$': // a Grafana variable: $namespace, ${datasource}, $__rate_interval
			i++
			if i < len(rs) && rs[i] == '{' {
				if err := skipTo('{', '}'); err != nil {
					return nil, err
				}
				continue
			}
			for i < len(rs) && isIdent(rs[i]) {
				i++
			}
		case unicode.IsDigit(r) || r == '.': // numbers and durations: 0.99, 5m, 1e3
			for i < len(rs) && (isIdent(rs[i]) || rs[i] == '.') {
				i++
			}
		case r == '{': // matchers without a metric name: {__name__=~"..."}
			labels, err := matchers(rs, &i)
			if err != nil {
				return nil, fmt.Errorf("%w in %q", err, expr)
			}
			out = append(out, selector{labels: labels})
		case isIdentStart(r):
			start := i
			for i < len(rs) && isIdent(rs[i]) {
				i++
			}
			word := string(rs[start:i])
			next := peek()
			switch {
			case labelLists[word] && next == '(':
				for rs[i] != '(' {
					i++
				}
				if err := skipTo('(', ')'); err != nil {
					return nil, err
				}
			case next == '(' || promqlKeywords[strings.ToLower(word)] || aggregations[word]:
				// a function or an aggregation; its arguments follow
			default:
				s := selector{metric: word}
				if next == '{' {
					for rs[i] != '{' {
						i++
					}
					labels, err := matchers(rs, &i)
					if err != nil {
						return nil, fmt.Errorf("%w in %q", err, expr)
					}
					s.labels = labels
				}
				out = append(out, s)
			}
		default:
			i++
		}
	}
	return out, nil
}

// matchers reads {name op "value", ...} at rs[*i] and returns the names.
func matchers(rs []rune, i *int) ([]string, error) {
	*i++ // {
	var names []string
	for *i < len(rs) {
		r := rs[*i]
		switch {
		case r == '}':
			*i++
			return names, nil
		case unicode.IsSpace(r) || r == ',':
			*i++
		case r == '"' || r == '\'' || r == '`':
			if err := skipString(rs, i); err != nil {
				return nil, err
			}
		case r == '=' || r == '!' || r == '~':
			*i++
		default:
			start := *i
			for *i < len(rs) && (rs[*i] == '_' || unicode.IsLetter(rs[*i]) || unicode.IsDigit(rs[*i])) {
				*i++
			}
			if *i == start {
				return nil, fmt.Errorf("unexpected %q in label matchers", r)
			}
			names = append(names, string(rs[start:*i]))
		}
	}
	return nil, fmt.Errorf("unclosed {")
}

// skipString moves past the quoted string at rs[*i].
func skipString(rs []rune, i *int) error {
	q := rs[*i]
	for *i++; *i < len(rs); *i++ {
		if rs[*i] == '\\' && q != '`' {
			*i++
			continue
		}
		if rs[*i] == q {
			*i++
			return nil
		}
	}
	return fmt.Errorf("unclosed string")
}

func TestSelectors(t *testing.T) {
	cases := []struct {
		expr string
		want []selector
	}{
		{`lumen_worker_num_requests_running`, []selector{{metric: "lumen_worker_num_requests_running"}}},
		{`histogram_quantile(0.99, sum by (le, pod) (rate(lumen_gateway_time_to_first_token_seconds_bucket{namespace=~"$namespace"}[$__rate_interval])))`,
			[]selector{{"lumen_gateway_time_to_first_token_seconds_bucket", []string{"namespace"}}}},
		{`sum without (instance) (lumen_worker_kv_pages_used) / on (pod) group_left sum by (pod) (lumen_worker_kv_pages_total{job="x", pod!~"a,b}"})`,
			[]selector{{metric: "lumen_worker_kv_pages_used"}, {"lumen_worker_kv_pages_total", []string{"job", "pod"}}}},
		{`max by (phase) (lumen_worker_phase == 1) or vector(0) and 1e3 > bool 2`, []selector{{metric: "lumen_worker_phase"}}},
		{`rate(x[5m] offset 1h) + ${datasource_thing} * "a(b)"`, []selector{{metric: "x"}}},
	}
	for _, c := range cases {
		got, err := selectors(c.expr)
		if err != nil {
			t.Errorf("%s: %v", c.expr, err)
			continue
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s:\n got  %+v\n want %+v", c.expr, got, c.want)
		}
	}
	if _, err := selectors(`x{a="b}`); err == nil {
		t.Error("an unclosed string was not an error")
	}
}
