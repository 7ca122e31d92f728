#pragma once
// Syntax tree of a parsed template. Shapes follow jinja2.nodes so evaluation order and operator
// grouping match Jinja2's parser.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "text/jinja/value.h"

namespace tandem::text::jinja {

enum class ExprKind {
  kConst,
  kName,
  kGetAttr,  // children[0].name
  kGetItem,  // children[0][children[1]]
  kSlice,    // children[0..2]: start, stop, step (null when omitted); only inside kGetItem
  kCall,     // children[0](children[1..], kwargs)
  kFilter,   // children[0] | name(children[1..], kwargs); children[0] null in filter blocks
  kTest,     // children[0] is [not] name(children[1..], kwargs)
  kNeg,
  kPos,
  kNot,
  kBinary,  // name: + - * / // % **
  kAnd,
  kOr,
  kCompare,  // children[0] ops[k] children[k+1] ...
  kConcat,   // children joined with ~
  kCond,     // children[1] if children[0] else children[2] (null: undefined)
  kList,
  kTuple,
  kDict,   // children: key0, value0, key1, value1, ...
  kNsRef,  // assignment target name.attr (namespace attribute)
};

struct Expr {
  ExprKind kind;
  int line = 0;
  Value value;           // kConst
  std::string name;      // kName, kGetAttr, kFilter, kTest, kBinary, kNsRef (variable name)
  std::string attr;      // kNsRef attribute
  bool negated = false;  // kTest: `is not`
  std::vector<std::unique_ptr<Expr>> children;
  std::vector<std::pair<std::string, std::unique_ptr<Expr>>> kwargs;
  std::vector<std::string> ops;  // kCompare: == != < <= > >= in notin
  // Levels of the tree from this node down: evaluating and freeing it recurse that deep.
  int height = 1;
};

enum class StmtKind {
  kData,
  kOutput,
  kIf,        // expr; body; else_body (elif chains nest an kIf there)
  kFor,       // target in expr [if filter]; body; else_body
  kSet,       // target = expr
  kSetBlock,  // target = rendered body, piped through filters
  kMacro,     // name(params = defaults); body
  kBreak,
  kContinue,
  kFilterBlock,  // rendered body piped through filters
  kScope,        // transformers' {% generation %}: renders its body in an inner scope
};

struct Stmt {
  StmtKind kind;
  int line = 0;
  std::string text;  // kData
  std::unique_ptr<Expr> expr;
  std::unique_ptr<Expr> target;
  std::unique_ptr<Expr> filter;                // kFor: the inline `if`
  std::vector<std::unique_ptr<Expr>> filters;  // kSetBlock, kFilterBlock
  std::vector<std::unique_ptr<Stmt>> body;
  std::vector<std::unique_ptr<Stmt>> else_body;
  std::string name;                             // kMacro
  std::vector<std::string> params;              // kMacro
  std::vector<std::unique_ptr<Expr>> defaults;  // kMacro: one per param, null when none
  // kMacro: the body reads `varargs` / `kwargs`, so extra positional / keyword arguments are
  // collected into them instead of being an error.
  bool catch_varargs = false;
  bool catch_kwargs = false;
};

using Body = std::vector<std::unique_ptr<Stmt>>;

// Parses template source. Throws tandem::Error naming the line for syntax errors and for
// constructs outside the supported subset.
Body parse_template(const std::string& source);

}  // namespace tandem::text::jinja
